"""Every file under configs/ is a valid run config, and broken configs fail loudly.

A broken config must be refused with a :class:`ConfigError` whose message names
the offending field — through the Python API here, and through the CLI, which
must exit non-zero before starting anything (tests/integration/operator/test_config_errors_cli.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from edgepfl.config import AggregationSpec, ConfigError, RunConfig, load_run_config
from edgepfl.methods import available_methods, get_method

REPO = Path(__file__).resolve().parents[3]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# the rest are one per method; these describe a situation (the demo; fleets of unequal or sleepy devices; a private one)
SCENARIOS = {"demo", "unequal_fleet", "sleepy_fleet", "private_fleet"}
#: scenarios that set the aggregation section themselves (a secure round takes no per-update bound)
OWN_AGGREGATION = {"private_fleet"}
METHOD_CONFIGS = [p for p in CONFIGS if p.stem not in SCENARIOS]


def test_there_is_a_config_for_every_registered_method():
    assert {p.stem for p in METHOD_CONFIGS} >= set(available_methods())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_method_options_validate(path):
    config = load_run_config(path)
    assert isinstance(config, RunConfig)
    options = config.method_config()
    assert isinstance(options, get_method(config.method.name).config_class)
    # the method options reach the method exactly as written: none dropped, renamed or coerced
    written = (yaml.safe_load(path.read_text()) or {}).get("method", {})
    assert config.method.options() == {k: v for k, v in written.items() if k != "name"}
    assert options.model_dump(include=set(written) - {"name"}) == {k: v for k, v in written.items() if k != "name"}


@pytest.mark.parametrize("path", METHOD_CONFIGS, ids=lambda p: p.name)
def test_method_config_is_named_after_its_method_and_uses_fmnist(path):
    config = load_run_config(path)
    assert config.method.name == path.stem
    assert config.data.dataset == "fmnist"
    assert config.federation == f"fmnist-{path.stem}"  # distinct federations: runs never share topics


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem not in OWN_AGGREGATION], ids=lambda p: p.name)
def test_shipped_configs_aggregate_with_the_default_rule_and_guard(path):
    """The aggregation section came later: a config without one gets ``auto`` and the
    default guard, which for these unsigned fleets is FedAvg's weighted mean (DualFed:
    unweighted, by its update weight), and for the same fleet enrolled a robust rule."""
    config = load_run_config(path)
    assert config.aggregation == AggregationSpec() and config.aggregation.rule == "auto"
    assert config.security.enrolled_dir is None and config.aggregation.build().streaming
    assert not config.aggregation.build(enrolled=True, updates=4).streaming


def test_an_aggregation_section_parses(tmp_path):
    data = yaml.safe_load((REPO / "configs" / "fedavg.yaml").read_text())
    data["aggregation"] = {"rule": "trimmed_mean", "trim_fraction": 0.1, "max_change_ratio": None,
                           "rollback_after": 5}
    path = tmp_path / "robust.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_run_config(path).aggregation
    assert (spec.rule, spec.trim_fraction, spec.max_change_ratio, spec.rollback_after) == ("trimmed_mean", 0.1, None, 5)
    assert not spec.build().streaming


@pytest.mark.parametrize("aggregation, why", [
    ({"rule": "multi_krum", "krum_select": 4}, "would drop nothing"),
    ({"rule": "multi_krum", "krum_byzantine": 0}, "krum_byzantine"),
    ({"rule": "trimmed_mean", "trim_fraction": 0.0}, "trim_fraction"),
])
def test_a_robust_rule_configured_to_do_nothing_is_refused(tmp_path, aggregation, why):
    data = yaml.safe_load((REPO / "configs" / "fedavg.yaml").read_text())
    data.update(aggregation=aggregation, min_agents=4)
    path = tmp_path / "robust.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=why):
        load_run_config(path)
    data["aggregation"] = {**aggregation, "krum_select": 3} if "krum_select" in aggregation else {"rule": "median"}
    path.write_text(yaml.safe_dump(data))
    assert load_run_config(path).aggregation.rule in ("multi_krum", "median")


def _broken(tmp_path: Path, mutate) -> Path:
    data = yaml.safe_load((REPO / "configs" / "fedpac.yaml").read_text())
    data = copy.deepcopy(data)
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BROKEN = {
    "unknown top-level field": (lambda d: d.update(roundz=3), "roundz"),
    "unknown nested field": (lambda d: d["train"].update(learning_rate=0.1), "train.learning_rate"),
    "wrong type": (lambda d: d["train"].update(lr="fast"), "train.lr"),
    "out of range": (lambda d: d.update(fraction=1.5), "fraction"),
    "unknown partition": (lambda d: d["data"]["partition"].update(kind="weird"), "data.partition.kind"),
    "unknown method": (lambda d: d["method"].update(name="fedmagic"), "method.name"),
    "unknown method option": (lambda d: d["method"].update(lamda=1.0), "method.lamda"),
    "wrong method option type": (lambda d: d["method"].update(body_epochs="five"), "method.body_epochs"),
    "unknown aggregation rule": (lambda d: d.update(aggregation={"rule": "average"}), "aggregation.rule"),
    "aggregation option out of range": (lambda d: d.update(aggregation={"trim_fraction": 0.5}),
                                        "aggregation.trim_fraction"),
}


@pytest.mark.parametrize("case", list(BROKEN), ids=lambda c: c.replace(" ", "-"))
def test_broken_config_raises_config_error_naming_the_field(case, tmp_path):
    mutate, field = BROKEN[case]
    path = _broken(tmp_path, mutate)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    message = str(info.value)
    assert f"{field}:" in message, message
    assert str(path) in message


def test_unknown_method_lists_the_available_ones(tmp_path):
    path = _broken(tmp_path, BROKEN["unknown method"][0])
    with pytest.raises(ConfigError, match="fedmagic") as info:
        load_run_config(path)
    assert "fedpac" in str(info.value) and "repper" in str(info.value)


@pytest.mark.parametrize("url", ["http://broker:1883", "mqtt://user:secret@broker", "mqtt://", "broker:1883"])
def test_a_broker_url_that_cannot_work_is_a_config_error_when_loaded(tmp_path, url):
    data = yaml.safe_load((REPO / "configs" / "fedavg.yaml").read_text())
    data["broker"] = {"url": url}
    path = tmp_path / "bad_broker.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="broker.url"):
        load_run_config(path)
    data["broker"] = {"url": "mqtts://broker.example:8883"}
    path.write_text(yaml.safe_dump(data))
    assert not load_run_config(path).broker.embedded


def test_the_sites_example_configs_validate_as_a_central_run_and_a_site_aggregator():
    """examples/sites/: what docs/OPERATING.md ("Sites") starts a fleet of sites from."""
    from edgepfl.site_config import load_aggregator_config

    central = load_run_config(REPO / "examples" / "sites" / "central.yaml")
    site = load_aggregator_config(REPO / "examples" / "sites" / "site-a.yaml")
    assert central.sites.enabled and site.site_id in central.sites.ids
    assert site.central.federation == central.federation != site.site.federation
    assert (site.site.method.name, site.site.model.arch) == (central.method.name, central.model.arch)


@pytest.mark.parametrize(("settings", "refused"), [
    ({"aggregation": {"rule": "median"}}, "needs every single update"),
    ({"method": {"name": "fedpac"}}, "needs every update"),
    ({"asynchrony": {"mode": "buffered"}}, "buffered rounds take sites in summary"),
    ({"secure_aggregation": {"enabled": True}, "min_agents": 3}, "neither secure aggregation nor differential privacy"),
    ({"asynchrony": {"mode": "buffered"}, "sites": {"mode": "summary"}}, None),
    ({"aggregation": {"rule": "clipped_mean"}}, None),
])
def test_sites_take_only_what_a_partial_sum_can_serve(settings, refused):
    """A site sends the sum of its devices' updates: a run of sites refuses, at validation and by
    name, what needs the single updates; buffered states take summary sites, whose late sums fold in."""
    base = {"method": {"name": "fedavg"}, "sites": {"enabled": True, "ids": ["site-a"]}}
    for key, value in settings.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    if refused is None:
        RunConfig.model_validate(base)
    else:
        with pytest.raises(ValueError, match=refused):
            RunConfig.model_validate(base)
