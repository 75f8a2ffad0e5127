"""Head tier runtime: install, persist, restore, refuse bad releases, offline heads (that
it never imports torch, in a fresh interpreter: tests/integration/agent/test_head_tier_without_torch.py)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from edgepfl.edge_agent import head_tier
from edgepfl.edge_agent.head_tier import HeadRuntime, ReleaseRefused, interleaved_ratio
from edgepfl.export.onnx_export import read_release, sha256_bytes

from tests.export_fixtures import NEW_CLIENT, client_data, export_dir


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rel")
    first = export_dir(tmp, "fedavg", rounds=1)
    second = export_dir(tmp, "dualfed", rounds=2)  # one round leaves h_s too weak for the logit sum
    return [first, second]


@pytest.fixture()
def data():
    return client_data(NEW_CLIENT)


def _install(rt, release_dir):
    manifest, artifact = read_release(release_dir)
    return rt.install_release(manifest, artifact, manifest.encoder.sha256)


def test_install_fit_evaluate_persist_and_restore(releases, data, tmp_path):
    rt = HeadRuntime(tmp_path / "state", "lr", data)
    metrics = _install(rt, releases[0])
    manifest, _ = read_release(releases[0])
    assert metrics.release_id == manifest.release_id and metrics.head == "lr"
    assert metrics.num_train == data.num_train and metrics.num_test == data.num_test
    assert metrics.accuracy > 0.5 and metrics.eval_correct == round(metrics.accuracy * data.num_test)
    assert metrics.fit_seconds >= 0 and metrics.latency_ratio is None  # nothing installed before it to time
    pred = rt.predict(data.x_test)
    assert (pred == data.y_test).mean() == pytest.approx(metrics.accuracy)
    assert rt.predict_proba(data.x_test[:3]).shape == (3, len(rt.classes))

    # a restarted agent restores encoder and head from disk, without refitting
    again = HeadRuntime(tmp_path / "state", "lr", data)
    assert again.load() == metrics
    np.testing.assert_array_equal(again.predict(data.x_test), pred)
    # the retained release delivered again is not refitted
    assert _install(again, releases[0]) == metrics

    # a new release is installed beside the one before it (kept for a rollback), not beside older ones
    m2 = _install(rt, releases[1])
    assert m2.release_id != metrics.release_id and rt.record.previous.release_id == metrics.release_id
    # the two encoders were timed beside each other on this device (the rollout's latency gate)
    assert m2.latency_ratio is not None and 0 < m2.latency_ratio < float("inf")
    assert m2.values()["latency_ratio"] == m2.latency_ratio
    # the two encoders and their two heads, each file named by its content
    state = tmp_path / "state"
    onnx_files = sorted(p.name for p in state.glob("*.onnx"))
    assert len(onnx_files) == 4 and all(sha256_bytes((state / n).read_bytes())[:16] in n for n in onnx_files)
    assert set(onnx_files) == {rt.record.encoder_file, rt.record.head_file, rt.record.previous.encoder_file,
                               rt.record.previous.head_file}


def test_nothing_installed_yet(tmp_path, data):
    rt = HeadRuntime(tmp_path / "s", "svm", data)
    with pytest.raises(FileNotFoundError):
        rt.load()
    with pytest.raises(RuntimeError, match="no encoder release"):
        rt.predict(data.x_test)


def _refused(rt, caplog, manifest, artifact, sha, match):
    with caplog.at_level(logging.ERROR, logger="edgepfl.agent.head"):
        with pytest.raises(ReleaseRefused, match=match):
            rt.install_release(manifest, artifact, sha)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("refused" in ln and match.split()[0] in ln for ln in lines), lines
    caplog.clear()
    return lines[-1]


def test_tampered_or_corrupt_releases_are_refused_and_the_old_one_stays(releases, data, tmp_path, caplog):
    state = tmp_path / "state"
    rt = HeadRuntime(state, "svm", data)
    good = _install(rt, releases[0])
    before = rt.predict_proba(data.x_test)
    record = (state / "release.json").read_bytes()
    manifest, artifact = read_release(releases[1])

    # tampered: one flipped byte, the release's checksum unchanged
    bad = bytearray(artifact)
    bad[len(bad) // 2] ^= 0xFF
    line = _refused(rt, caplog, manifest, bytes(bad), manifest.encoder.sha256, "sha256 mismatch")
    assert manifest.release_id in line and good.release_id in line  # names the new and the kept release

    # checksum consistent with the bytes, but the bytes are not an ONNX model
    junk = b"not an onnx model" * 100
    forged = manifest.model_copy(update={"encoder": manifest.encoder.model_copy(update={"sha256": sha256_bytes(junk)})})
    _refused(rt, caplog, forged, junk, sha256_bytes(junk), "not a loadable ONNX")

    # manifest and release header disagree
    _refused(rt, caplog, manifest, artifact, "0" * 64, "sha256 mismatch")

    # an encoder for other images (input shape) than this device holds
    run = manifest.run
    other_data = run.data.model_copy(update={"input_shape": (3, 32, 32)})
    other = manifest.model_copy(update={"run": run.model_copy(update={"data": other_data})})
    _refused(rt, caplog, other, artifact, manifest.encoder.sha256, "input shape mismatch")

    # the old release is still served and still on disk
    assert rt.release_id == good.release_id
    np.testing.assert_array_equal(rt.predict_proba(data.x_test), before)
    assert (state / "release.json").read_bytes() == record
    restarted = HeadRuntime(state, "svm", data)
    assert restarted.load() == good


def test_offline_head_is_used_for_its_encoder_only(releases, data, tmp_path, caplog):
    from edgepfl.export.fit_head import main_fit_head

    state = tmp_path / "state"
    state.mkdir()
    npz = tmp_path / "d.npz"
    from tests.export_fixtures import client_pixels

    px, y, _ = client_pixels(NEW_CLIENT)
    np.savez(npz, x=px, y=y)
    # a DualFed head fitted offline (needs torch) and shipped to a device that has none
    assert main_fit_head(["--encoder", str(releases[1] / "encoder.onnx"), "--data", str(npz), "--head", "dualfed",
                          "--out", str(state / "head.offline.onnx")]) == 0
    rt = HeadRuntime(state, "onnx", data)
    # for another encoder the offline head does not fit: an 'onnx' device refuses that release
    _refused(rt, caplog, *_release_args(releases[0]), "head kind 'onnx' needs")
    metrics = _install(rt, releases[1])
    assert metrics.head == "dualfed" and metrics.accuracy > 0.5
    # an 'lr' device with the same offline file prefers it for the matching encoder only
    rt2 = HeadRuntime(tmp_path / "s2", "lr", data)
    (tmp_path / "s2").mkdir()
    (tmp_path / "s2" / "head.offline.onnx").write_bytes((state / "head.offline.onnx").read_bytes())
    assert _install(rt2, releases[0]).head == "lr"
    assert _install(rt2, releases[1]).head == "dualfed"


def test_a_head_kind_the_releases_method_does_not_offer_is_refused(releases, data, tmp_path, caplog):
    """A 'dualfed' device: a FedAvg release has no such head; a DualFed one over MQTT lacks its global heads."""
    rt = HeadRuntime(tmp_path / "state", "dualfed", data)
    line = _refused(rt, caplog, *_release_args(releases[0]), "no dualfed head")
    assert "does not fit a fedavg encoder" in line
    line = _refused(rt, caplog, *_release_args(releases[1]), "no dualfed head")
    assert "needs the federation's global heads" in line
    assert rt.release_id is None and not (tmp_path / "state" / "release.json").exists()


def test_no_session_is_open_while_the_fit_child_runs_and_a_failed_fit_reopens_the_installed_release(
        releases, data, tmp_path, caplog, monkeypatch):
    """The fit child runs beside the agent on a device capped at 150 MB: the agent holds no
    encoder session then (the installed release's nor the new one's). A fit that fails leaves
    the installed release serving, reopened from disk; one that succeeds serves the new."""
    from edgepfl.edge_agent import head_fit

    rt = HeadRuntime(tmp_path / "state", "lr", data.paged(tmp_path / "samples"))
    first = _install(rt, releases[0])
    before = rt.predict_proba(data.x_test)
    seen = []
    real = head_fit.fit_in_child

    def watched(*args, **kwargs):
        seen.append((rt.encoder, rt.head))
        return real(*args, **kwargs)

    monkeypatch.setattr(head_fit, "fit_in_child", watched)
    rt.head_kind = "dualfed"  # a DualFed release without its global heads: refused by the fit itself
    _refused(rt, caplog, *_release_args(releases[1]), "no dualfed head")
    assert seen == [(None, None)]
    assert rt.ready and rt.release_id == first.release_id
    np.testing.assert_array_equal(rt.predict_proba(data.x_test), before)
    rt.head_kind = "lr"
    second = _install(rt, releases[1])
    assert seen[1] == (None, None) and rt.release_id == second.release_id
    assert (rt.predict(data.x_test) == data.y_test).mean() == pytest.approx(second.accuracy)


def test_paged_samples_are_the_same_samples_read_from_a_file(data, tmp_path):
    paged = data.paged(tmp_path / "samples")
    for name in ("x_train", "x_test"):
        assert isinstance(getattr(paged, name), np.memmap)
        np.testing.assert_array_equal(getattr(paged, name), getattr(data, name))
    assert paged.num_train == data.num_train and paged.class_names == data.class_names
    again = data.paged(tmp_path / "samples")  # a restart writes them anew; the earlier map still reads
    np.testing.assert_array_equal(paged.x_test, again.x_test)


def test_a_release_carrying_its_global_heads_gets_the_methods_own_head(releases, data, tmp_path, caplog):
    """The release's ``global_heads`` bytes (PROTOCOL.md §12) are all a device needs beside the
    encoder for a DualFed head: verified against the manifest, kept with the installed release."""
    from edgepfl.export.onnx_export import read_global_heads

    manifest, artifact, sha = _release_args(releases[1])
    heads = read_global_heads(releases[1], manifest)
    assert heads is not None
    state = tmp_path / "state"
    rt = HeadRuntime(state, "dualfed", data)
    # heads that are not the manifest's, or a manifest that names none: refused before anything is fitted
    with caplog.at_level(logging.ERROR, logger="edgepfl.agent.head"):
        with pytest.raises(ReleaseRefused, match="global heads are"):
            rt.install_release(manifest, artifact, sha, global_heads=heads[:-1] + bytes([heads[-1] ^ 1]))
        with pytest.raises(ReleaseRefused, match="manifest does not name"):
            rt.install_release(manifest.model_copy(update={"global_heads": None}), artifact, sha, global_heads=heads)
    assert rt.release_id is None and not list(state.glob("global-heads-*"))  # no orphan left behind

    metrics = rt.install_release(manifest, artifact, sha, global_heads=heads)
    assert metrics.head == "dualfed" and metrics.accuracy > 0.5
    record = json.loads((state / "release.json").read_text())
    assert (state / record["global_heads_file"]).read_bytes() == heads
    assert record["global_heads_sha256"] == manifest.global_heads.sha256
    # a restarted agent serves the same head without refitting
    restored = HeadRuntime(state, "dualfed", data)
    assert restored.load() == metrics
    np.testing.assert_array_equal(restored.predict(data.x_test), rt.predict(data.x_test))

    # the next release (without global heads, say from a 1.1 coordinator, for an lr device) keeps the file
    # with the release before it, and the one after that removes it
    lr = HeadRuntime(state, "lr", data)
    lr.load()
    _install(lr, releases[0])
    assert [p.name for p in state.glob("global-heads-*")] == [record["global_heads_file"]]
    lr.install_release(manifest.model_copy(update={"global_heads": None}), artifact, sha)
    assert not list(state.glob("global-heads-*"))


def _release_args(release_dir):
    manifest, artifact = read_release(release_dir)
    return manifest, artifact, manifest.encoder.sha256


def test_local_data_in_another_normalization_is_converted(releases, data, tmp_path):
    """A device whose loader normalized differently (e.g. an image folder) still feeds the encoder right."""
    from edgepfl.data.client import ClientData

    ref = HeadRuntime(tmp_path / "a", "lr", data)
    m_ref = _install(ref, releases[0])
    mean, std = np.float32(data.normalization["mean"][0]), np.float32(data.normalization["std"][0])

    def other(x):  # the same pixels, normalized with mean 0.5 / std 0.5
        return ((x * std + mean) - 0.5) / 0.5

    shifted = ClientData(other(data.x_train), data.y_train, other(data.x_test), data.y_test, data.num_classes,
                         normalization={"mean": [0.5], "std": [0.5]})
    rt = HeadRuntime(tmp_path / "b", "lr", shifted)
    m = _install(rt, releases[0])
    assert m.accuracy == pytest.approx(m_ref.accuracy)
    np.testing.assert_allclose(rt.features(shifted.x_test), ref.features(data.x_test), atol=1e-4)
    restored = HeadRuntime(tmp_path / "b", "lr", shifted)
    restored.load()
    np.testing.assert_array_equal(restored.predict(shifted.x_test), rt.predict(shifted.x_test))


def test_installed_files_work_with_the_predict_cli(releases, data, tmp_path, capsys):
    from edgepfl.export.predict import main_predict

    rt = HeadRuntime(tmp_path / "state", "mlp", data)
    _install(rt, releases[0])
    record = json.loads((tmp_path / "state" / "release.json").read_text())
    npy = tmp_path / "x.npy"
    np.save(npy, data.x_test[:6])
    rc = main_predict(["--encoder", str(tmp_path / "state" / record["encoder_file"]),
                       "--head", str(tmp_path / "state" / record["head_file"]), str(npy), "--preprocessed", "--json"])
    rows = [json.loads(s) for s in capsys.readouterr().out.splitlines()]
    assert rc == 0
    np.testing.assert_array_equal([r["predictions"][0]["index"] for r in rows], rt.predict(data.x_test[:6]))


def test_the_installed_encoder_under_another_preprocessing_is_fitted_and_measured_again(releases, data, tmp_path):
    """A release whose manifest alone changed (the same encoder, its pixels scaled otherwise)
    changes every prediction: it was adopted with the head kept and the old report re-sent,
    so it passed a rollout's canary unmeasured. Now it is installed and fitted like any
    other release, and what the device reports is what it will run; a manifest that differs
    only in what names the release is still adopted without a fit."""
    manifest, artifact = read_release(releases[0])
    rt = HeadRuntime(tmp_path / "state", "lr", data)
    first = rt.install_release(manifest, artifact, manifest.encoder.sha256)
    head_file = rt.record.head_file

    renamed = manifest.model_copy(update={"release_id": "fedavg-r7-renamed", "round": 7, "created": "2030-01-01"})
    same = rt.install_release(renamed, artifact, manifest.encoder.sha256)
    assert rt.record.head_file == head_file and same.accuracy == first.accuracy  # adopted: nothing to measure

    data_shape = manifest.run.data.model_copy(update={"pixel_scale": manifest.run.data.pixel_scale * 16})
    rescaled = manifest.model_copy(update={"release_id": "fedavg-r8-rescaled",
                                           "run": manifest.run.model_copy(update={"data": data_shape})})
    again = rt.install_release(rescaled, artifact, manifest.encoder.sha256)
    assert rt.record.release_id == "fedavg-r8-rescaled" and rt.record.manifest.run.data.pixel_scale == data_shape.pixel_scale
    assert again.accuracy != first.accuracy  # measured on what the device now computes, not the old report
    assert rt.record.manifest == rescaled
    # and the head kept for a rollback is the one fitted before it (heads are named by content, not
    # by their encoder, which both share): the rollout's halt restores it from the kept files
    back = rt.restore_release(renamed, manifest.encoder.sha256, sequence=None)
    assert back.accuracy == first.accuracy and rt.record.head_file == head_file


def test_the_installed_encoder_in_a_newer_release_is_recorded_under_it_and_reverified_on_restart(
        releases, data, tmp_path):
    """A coordinator that releases an unchanged state publishes the same encoder under a new
    release id and sequence: the agent keeps its head (no refit) but records the new release,
    so that it names what it has as the coordinator does (PROTOCOL.md §12, releases by
    reference); with a pinned key the new proof re-verifies on restart."""
    from edgepfl.protocol import MessageType, ReleaseMeta, decode, encode
    from edgepfl.protocol.manifest import release_tensors
    from edgepfl.protocol.signing import generate_keypair, load_public_key, load_signer

    generate_keypair(tmp_path / "c.key", tmp_path / "c.pub")
    signer, key = load_signer(tmp_path / "c.key"), load_public_key(tmp_path / "c.pub")
    manifest, artifact = read_release(releases[0])

    def signed(release_id: str, sequence: int):
        meta = ReleaseMeta(release_id=release_id, manifest=manifest.model_copy(update={"release_id": release_id}),
                           sha256=manifest.encoder.sha256, size_bytes=len(artifact), sequence=sequence,
                           expires=4e9)
        message = decode(encode(MessageType.RELEASE, federation="f", sender="coordinator", round=0, meta=meta,
                                tensors=release_tensors(artifact, None), signer=signer))
        return message.meta, message.signed_part + message.signature

    def install(rt, release_id, sequence):
        meta, proof = signed(release_id, sequence)
        return rt.install_release(meta.manifest, artifact, meta.sha256, sequence=sequence, expires=meta.expires,
                                  proof=proof)

    state = tmp_path / "state"
    rt = HeadRuntime(state, "lr", data, coordinator_key=key)
    first = install(rt, "fedavg-r0-same", 10)
    head_file = rt.record.head_file
    head_written = (state / head_file).stat().st_mtime_ns
    again = install(rt, "fedavg-r1-same", 11)
    assert again.release_id == "fedavg-r1-same" and again.accuracy == first.accuracy
    assert (rt.record.release_id, rt.record.sequence) == ("fedavg-r1-same", 11)
    assert rt.record.head_file == head_file and (state / head_file).stat().st_mtime_ns == head_written  # not refitted
    assert len(list(state.glob("*.proof"))) == 1  # the earlier release's proof is gone

    restarted = HeadRuntime(state, "lr", data, coordinator_key=key)
    assert restarted.load().release_id == "fedavg-r1-same" and restarted.record.sequence == 11
    with pytest.raises(ReleaseRefused, match="rollback"):  # the earlier release is a rollback now
        install(restarted, "fedavg-r0-same", 10)


def test_a_rollback_restores_the_kept_release_without_a_download_or_a_fit_and_refuses_the_bad_one(
        releases, data, tmp_path):
    """Protocol 1.8: the release before the installed one is kept; a signed ``restore`` of it,
    under a new sequence, switches back to its encoder and head as they were, removes the bad
    release's files, re-verifies on restart, and leaves the bad release refused as a rollback."""
    from edgepfl.protocol import MessageType, ReleaseMeta, decode, encode
    from edgepfl.protocol.manifest import release_tensors
    from edgepfl.protocol.signing import generate_keypair, load_public_key, load_signer

    generate_keypair(tmp_path / "c.key", tmp_path / "c.pub")
    signer, key = load_signer(tmp_path / "c.key"), load_public_key(tmp_path / "c.pub")

    def signed(release_dir, sequence: int, restore: bool = False):
        manifest, artifact = read_release(release_dir)
        meta = ReleaseMeta(release_id=manifest.release_id, manifest=manifest, sha256=manifest.encoder.sha256,
                           size_bytes=len(artifact), sequence=sequence, expires=4e9, restore=restore)
        tensors = {} if restore else release_tensors(artifact, None)
        message = decode(encode(MessageType.RELEASE, federation="f", sender="coordinator", round=0, meta=meta,
                                tensors=tensors, signer=signer))
        return message.meta, artifact, message.signed_part + message.signature

    def install(rt, release_dir, sequence):
        meta, artifact, proof = signed(release_dir, sequence)
        return rt.install_release(meta.manifest, artifact, meta.sha256, sequence=sequence, expires=meta.expires,
                                  proof=proof)

    def restore(rt, release_dir, sequence):
        meta, _, proof = signed(release_dir, sequence, restore=True)
        return rt.restore_release(meta.manifest, meta.sha256, sequence=sequence, expires=meta.expires, proof=proof)

    state = tmp_path / "state"
    rt = HeadRuntime(state, "lr", data, coordinator_key=key)
    good = install(rt, releases[0], 10)
    good_files = {rt.record.encoder_file, rt.record.head_file}
    head_written = (state / rt.record.head_file).stat().st_mtime_ns
    pred_good = rt.predict(data.x_test)
    install(rt, releases[1], 11)
    bad_files = {rt.record.encoder_file, rt.record.head_file}

    with pytest.raises(ReleaseRefused, match="rollback"):  # a restore is sequenced like any release
        restore(rt, releases[0], 11)
    back = restore(rt, releases[0], 12)
    assert back.release_id == good.release_id and back.accuracy == good.accuracy
    assert (rt.record.release_id, rt.record.sequence, rt.record.previous) == (good.release_id, 12, None)
    assert (state / rt.record.head_file).stat().st_mtime_ns == head_written  # the kept head: no fit
    np.testing.assert_array_equal(rt.predict(data.x_test), pred_good)
    names = {p.name for p in state.iterdir()}
    assert good_files <= names and not bad_files & names  # the bad release's files are gone

    with pytest.raises(ReleaseRefused, match="rollback"):  # the release rolled back from, replayed
        install(rt, releases[1], 11)
    restarted = HeadRuntime(state, "lr", data, coordinator_key=key)  # the restore's proof re-verifies
    assert restarted.load() == back and restarted.record.sequence == 12
    # the installed release restored again: recorded under the new sequence, nothing else
    assert restore(restarted, releases[0], 13).accuracy == good.accuracy and restarted.record.sequence == 13
    with pytest.raises(ReleaseRefused, match="not held"):  # nothing kept of the other release any more
        restore(restarted, releases[1], 14)


def test_the_latency_ratio_is_timed_in_alternation_so_load_that_comes_and_goes_falls_on_both(monkeypatch):
    # a clock the two "encoders" advance: the new one costs 3 units, the old 1, times the load
    # of the moment, which is 5 for the first four timed calls and 1 after (another process
    # finishing); timed one after the other, the old one would look 5x faster than it is
    clock = {"now": 0.0, "calls": 0}

    def run(cost):
        def call():
            clock["calls"] += 1
            clock["now"] += cost * (5.0 if 2 < clock["calls"] <= 6 else 1.0)
        return call

    monkeypatch.setattr(head_tier.time, "perf_counter", lambda: clock["now"])
    assert interleaved_ratio(run(3.0), run(1.0), repeats=5) == pytest.approx(3.0)
    assert clock["calls"] == 2 + 2 * 5  # a warm-up each, then five of each


def test_an_older_release_offered_again_is_refused_each_time_and_logged_once_as_a_warning(releases, data, tmp_path,
                                                                                          caplog):
    """A held canary is offered the fleet's current (older) release at each reconnect: it
    refused it correctly and logged an ERROR each time (three in one rollout)."""
    import logging

    manifest, artifact = read_release(releases[0])
    rt = HeadRuntime(tmp_path / "state", "lr", data)
    rt.install_release(manifest, artifact, manifest.encoder.sha256, sequence=10)
    newer = manifest.model_copy(update={"release_id": "fedavg-r9-newer"})
    rt.install_release(newer, artifact, manifest.encoder.sha256, sequence=11)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="edgepfl"):
        for _ in range(3):
            with pytest.raises(ReleaseRefused, match="rollback"):
                rt.install_release(manifest, artifact, manifest.encoder.sha256, sequence=10)
    said = [r for r in caplog.records if "refused: rollback" in r.getMessage()]
    assert len(said) == 3 and [r.levelno for r in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert rt.record.release_id == "fedavg-r9-newer"


def test_the_reported_fit_time_is_the_childs_fit_not_its_start_up(releases, data, tmp_path, monkeypatch):
    """The agent reported the whole child process (interpreter, imports: 2.7-4.2 s) as the fit
    (0.99 s in fit-head for the same fit): now the child times ``fit`` and the agent reports that."""
    from edgepfl.edge_agent import head_fit

    returned: list[tuple[bytes, float]] = []
    real = head_fit.fit_in_child

    def recording(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(head_fit, "fit_in_child", recording)
    metrics = _install(HeadRuntime(tmp_path / "state", "lr", data), releases[0])
    assert len(returned) == 1 and metrics.fit_seconds == returned[0][1] > 0
