"""Retention's decisions (cua_rollout/runtime/retention.py) and its marker
(cua_rollout/core/retention.py): who keeps images, the sample by hash, lossless re-encoding,
the marker's round trip, the config's errors."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image
from pydantic import ValidationError

from cua_rollout.config import RetentionConfig, StorageConfig
from cua_rollout.core.layout import RETENTION_MARKER_FILE
from cua_rollout.core.retention import RetentionMarker, read_marker, write_marker
from cua_rollout.runtime.retention import keeps_images, reencode_image, sampled


def _record(episode_id: str, status: str) -> dict:
    return {"episode_id": episode_id, "status": status}


@pytest.mark.parametrize(("images", "kept"), [
    ("keep", {"success", "failure", "max_steps", "timeout", "infra_error"}),
    ("after_ack", set()),
    ("failures", {"failure", "max_steps", "timeout", "infra_error"}),
    ("successes", {"success"}),
])
def test_each_policy_keeps_the_images_of_the_statuses_it_names(images, kept):
    cfg = RetentionConfig(images=images)
    statuses = ("success", "failure", "max_steps", "timeout", "infra_error")
    assert {s for s in statuses if keeps_images(cfg, _record("d/t/0", s))} == kept


def test_the_sample_is_a_stable_hash_of_the_episode_id_near_its_fraction():
    cfg = RetentionConfig(images="sample", sample_fraction=0.25)
    ids = [f"d/task-{i}/{i % 4}" for i in range(4000)]
    first = [keeps_images(cfg, _record(e, "success")) for e in ids]
    assert first == [keeps_images(cfg, _record(e, "failure")) for e in ids]  # not by status
    assert 0.22 < sum(first) / len(ids) < 0.28
    assert not any(sampled(e, 0.0) for e in ids) and all(sampled(e, 1.0) for e in ids)
    # A larger fraction keeps a superset: raising it never drops a kept episode.
    assert all(sampled(e, 0.5) for e, kept in zip(ids, first, strict=True) if kept)


def _png(seed: int) -> bytes:
    image = Image.new("RGB", (64, 48))
    image.putdata([((x * seed) % 256, (x * 7) % 256, (x * 13 + seed) % 256)
                   for x in range(64 * 48)])
    out = io.BytesIO()
    image.save(out, "PNG", compress_level=1)
    return out.getvalue()


def test_png_max_keeps_every_pixel_and_webp_is_a_webp():
    data = _png(3)
    smaller = reencode_image(data, "png_max", 80)
    assert len(smaller) < len(data)
    with Image.open(io.BytesIO(data)) as a, Image.open(io.BytesIO(smaller)) as b:
        assert b.format == "PNG" and a.tobytes() == b.tobytes()
    with Image.open(io.BytesIO(reencode_image(data, "webp", 50))) as w:
        assert w.format == "WEBP" and w.size == (64, 48)
    with pytest.raises(ValueError, match="unknown reencode mode"):
        reencode_image(data, "gif", 80)


def test_the_marker_round_trips_and_says_what_happened(tmp):
    marker = RetentionMarker("after_ack", at=0.0, removed=["step_0.png", "step_1.png"],
                             bytes_freed=123)
    write_marker(tmp, marker, fsync=False)
    back = read_marker(tmp)
    assert back == marker and back.images_gone
    assert back.describe() == ("2 image(s) removed by retention policy after_ack at "
                               "1970-01-01 00:00:00 UTC")
    assert back.replacement("step_0.png") is None
    lossless = RetentionMarker("keep", reencoded={"step_0.png": "step_0.png"}, reencode="png_max")
    assert not lossless.images_gone and lossless.replacement("step_0.png") == "step_0.png"
    lossy = RetentionMarker("keep", reencoded={"step_0.png": "step_0.webp"}, reencode="webp")
    assert lossy.images_gone and lossy.replacement("step_0.png") == "step_0.webp"
    (tmp / RETENTION_MARKER_FILE).write_text(json.dumps({"removed": []}))
    assert read_marker(tmp) is None  # not one the sweeper wrote
    assert read_marker(tmp / "nowhere") is None


def test_the_config_defaults_keep_everything_and_errors_name_the_key():
    cfg = StorageConfig()
    assert cfg.retention.images == "keep" and cfg.retention.reencode == "none"
    assert cfg.retention.max_gb is None and not cfg.retention.active
    assert StorageConfig(retention={"reencode": "png_max"}).retention.active
    for bad, key in ((({"images": "some"}), "retention.images"),
                     ({"max_gb": 0}, "retention.max_gb"),
                     ({"sample_fraction": 1.5}, "retention.sample_fraction"),
                     ({"maxgb": 1}, "retention.maxgb")):
        with pytest.raises(ValidationError, match=key.replace(".", r"\.")):
            StorageConfig(retention=bad)
    with pytest.raises(ValidationError, match=r"storage\.retention\.images: after_ack needs "
                                              r"storage\.index: true"):
        StorageConfig(index=False, retention={"images": "after_ack"})
