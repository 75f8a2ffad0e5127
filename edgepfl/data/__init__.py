"""Datasets from local files, partitioners and per-client train / test splits.

numpy-only at import time (the head tier uses it without torch)::

    from edgepfl.data import load_client_data
    data = load_client_data(run_config.data, client_index=3)
"""

from .client import ClientData, ClientTensors
from .datasets import (
    FMNIST_PACKAGE,
    FMNIST_ROOT,
    DataError,
    Pool,
    clear_cache,
    client_domain,
    client_indices,
    describe_partition,
    fmnist_available,
    load_client_data,
    load_imagefolder,
    load_pool,
    read_idx,
    resolve_kind,
)
from .domains import DOMAINS, apply_domain
from .partition import PARTITIONERS, PartitionError, partition, stratified_take
from .sensors import read_csv_windows
from .tsfile import bundled_ts_files, read_ts

__all__ = [
    "DOMAINS",
    "FMNIST_PACKAGE",
    "FMNIST_ROOT",
    "PARTITIONERS",
    "ClientData",
    "ClientTensors",
    "DataError",
    "PartitionError",
    "Pool",
    "apply_domain",
    "bundled_ts_files",
    "clear_cache",
    "client_domain",
    "client_indices",
    "describe_partition",
    "fmnist_available",
    "load_client_data",
    "load_imagefolder",
    "load_pool",
    "partition",
    "read_csv_windows",
    "read_idx",
    "read_ts",
    "resolve_kind",
    "stratified_take",
]
