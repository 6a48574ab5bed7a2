"""group_record (cua_rollout/training/groups.py) on groups whose figures are worked out by hand:
rewards, masking of infra failures, GRPO advantages, no-signal groups and model versions."""

from __future__ import annotations

import math

import pytest

from cua_rollout.training.groups import ADVANTAGE_EPS, fill_defaults, group_record


def ep(rollout, status="success", reward=1.0, *, started_at=None, version="v1", **extra):
    record = {
        "episode_id": f"chrome/abc/{rollout}", "task_id": "abc", "domain": "chrome",
        "rollout": rollout, "attempt": 0, "status": status, "reward": reward, "steps": 3,
        "started_at": float(started_at if started_at is not None else rollout),
        "ended_at": 100.0 + rollout, "instruction": "open it", "model_version": version,
    }
    record.update(extra)
    return record


def make(episodes, size=None):
    return group_record("chrome/abc/pass-0", domain="chrome", task_id="abc", pass_index=0,
                        group_size=size or len(episodes), episodes=episodes)


def test_rewards_one_zero_one_zero():
    g = make([ep(0, reward=1.0), ep(1, "failure", 0.0), ep(2, reward=1.0), ep(3, "failure", 0.0)])
    assert g["episode_ids"] == [f"chrome/abc/{i}" for i in range(4)]
    assert g["rewards"] == [1.0, 0.0, 1.0, 0.0]
    assert g["scored"] == 4
    assert g["mean"] == 0.5
    assert g["std"] == 0.5
    high = 0.5 / (0.5 + ADVANTAGE_EPS)
    assert g["advantages"] == {"chrome/abc/0": high, "chrome/abc/1": -high,
                               "chrome/abc/2": high, "chrome/abc/3": -high}
    assert math.isclose(high, 1.0, rel_tol=1e-5)
    assert g["masked"] == [] and g["infra_failures"] == 0
    assert g["no_signal"] is False
    assert g["size"] == 4 and g["pass_index"] == 0


def test_unequal_rewards_population_std():
    g = make([ep(0, reward=1.0), ep(1, "failure", 0.5), ep(2, "failure", 0.0)])
    assert g["mean"] == pytest.approx(0.5)
    std = math.sqrt((0.25 + 0 + 0.25) / 3)  # ddof=0
    assert g["std"] == pytest.approx(std)
    assert g["advantages"]["chrome/abc/0"] == pytest.approx(0.5 / (std + 1e-6))
    assert g["advantages"]["chrome/abc/1"] == pytest.approx(0.0)
    assert g["advantages"]["chrome/abc/2"] == pytest.approx(-0.5 / (std + 1e-6))


def test_all_equal_rewards_have_no_signal_and_zero_advantages():
    # 0.3 three times: summing would leave a rounding residue that 1e-6 would blow up.
    g = make([ep(0, "failure", 0.3), ep(1, "failure", 0.3), ep(2, "max_steps", 0.3)])
    assert g["no_signal"] is True
    assert g["mean"] == 0.3 and g["std"] == 0.0
    assert set(g["advantages"].values()) == {0.0}


def test_an_infra_error_is_masked_never_scored_zero():
    g = make([ep(0, reward=1.0), ep(1, "infra_error", None), ep(2, "failure", 0.0)])
    assert g["rewards"] == [1.0, None, 0.0]
    assert g["masked"] == ["chrome/abc/1"]
    assert g["infra_failures"] == 1
    assert g["scored"] == 2
    assert g["mean"] == 0.5  # not 1/3: the infra error is not a zero
    assert g["advantages"]["chrome/abc/1"] is None
    assert g["advantages"]["chrome/abc/0"] == pytest.approx(1.0, rel=1e-5)
    assert g["no_signal"] is False


def test_an_infra_error_with_a_stray_reward_is_still_masked():
    g = make([ep(0, reward=1.0), ep(1, "infra_error", 0.0), ep(2, "failure", 0.0)])
    assert g["rewards"] == [1.0, None, 0.0]
    assert g["masked"] == ["chrome/abc/1"]


def test_a_single_scored_episode_has_no_signal():
    g = make([ep(0, reward=1.0), ep(1, "infra_error", None), ep(2, "infra_error", None)])
    assert g["scored"] == 1
    assert g["no_signal"] is True
    assert g["mean"] == 1.0 and g["std"] == 0.0
    assert g["advantages"] == {"chrome/abc/0": 0.0, "chrome/abc/1": None, "chrome/abc/2": None}
    assert g["infra_failures"] == 2


def test_nothing_scored():
    g = make([ep(0, "infra_error", None), ep(1, "infra_error", None)])
    assert g["mean"] is None and g["std"] is None and g["scored"] == 0
    assert g["advantages"] == {"chrome/abc/0": None, "chrome/abc/1": None}
    assert g["no_signal"] is True


def test_rollout_order_whatever_the_input_order():
    g = make([ep(2, reward=0.0), ep(0, reward=1.0), ep(1, reward=0.5)])
    assert g["episode_ids"] == ["chrome/abc/0", "chrome/abc/1", "chrome/abc/2"]
    assert g["rewards"] == [1.0, 0.5, 0.0]


def test_mixed_versions_across_episodes():
    # Started in the order 1, 0, 2: first/last follow started_at, not the rollout number.
    g = make([ep(0, started_at=5, version="v2"), ep(1, started_at=1, version="v1"),
              ep(2, started_at=9, version="v3", first_model_version="v2",
                 model_versions=["v2", "v3"], mixed_versions=True)])
    assert g["first_version"] == "v1"
    assert g["last_version"] == "v3"
    assert g["versions"] == ["v1", "v2", "v3"]
    assert g["mixed_versions"] is True


def test_one_episode_that_switched_versions_makes_the_group_mixed():
    g = make([ep(0, version="v1"),
              ep(1, version="v1", first_model_version="v0", model_versions=["v0", "v1"],
                 mixed_versions=True)])
    assert g["mixed_versions"] is True
    assert g["first_version"] == "v1"  # episode 0 started first
    assert g["versions"] == ["v1", "v0"]


def test_one_version_is_not_mixed():
    g = make([ep(0), ep(1, "failure", 0.0)])
    assert g["versions"] == ["v1"]
    assert g["mixed_versions"] is False
    assert g["first_version"] == g["last_version"] == "v1"


def test_versions_unknown():
    g = make([ep(0, version=None), ep(1, "failure", 0.0, version=None)])
    assert g["versions"] == [] and g["first_version"] is None and g["last_version"] is None
    assert g["mixed_versions"] is False


def test_fill_defaults_of_an_old_record():
    old = ep(0, version="v7")
    filled = fill_defaults(old)
    assert filled["pass_index"] == 0
    assert filled["group_id"] == "chrome/abc/pass-0"
    assert filled["first_model_version"] == "v7"
    assert filled["model_versions"] == ["v7"]
    assert filled["mixed_versions"] is False
    assert filled["group_size"] is None
    assert "group_id" not in old  # a copy


def test_fill_defaults_keeps_what_is_there():
    new = ep(0, version="v2", pass_index=3, group_id="g", group_size=8, first_model_version="v1",
             model_versions=["v1", "v2"])
    filled = fill_defaults(new)
    assert (filled["pass_index"], filled["group_id"], filled["group_size"]) == (3, "g", 8)
    assert filled["first_model_version"] == "v1"
    assert filled["mixed_versions"] is True
    assert fill_defaults(ep(0, pass_index=2))["group_id"] == "chrome/abc/pass-2"


def test_fill_defaults_names_a_field_that_is_not_an_integer():
    with pytest.raises(ValueError, match="pass_index: 'first' is not an integer"):
        fill_defaults(ep(0, pass_index="first"))
    with pytest.raises(ValueError, match=r"group_size: 2\.5 is not an integer"):
        fill_defaults(ep(0, group_size=2.5))
    assert fill_defaults(ep(0, pass_index="2"))["pass_index"] == 2
