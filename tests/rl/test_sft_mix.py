"""`sft.kwargs_mix`: SFT demonstrations from several variants of the env, split by share."""

from __future__ import annotations

import pytest

from rl.config.errors import ConfigError
from rl.config.runfile import load_config
from rl.run.env_checks import check_env
from rl.sft.warm_start import _shares, expert_demonstrations

MIX = "sft.kwargs_mix=[{share: 3, kwargs: {doc_tokens: 30}}, {kwargs: {doc_tokens: 300}}]"


def test_shares_split_the_count_by_weight_and_add_up():
    cfg = load_config("configs/long_horizon.yaml", [MIX])
    assert _shares(8, cfg.sft.kwargs_mix) == [6, 2]
    assert _shares(7, cfg.sft.kwargs_mix) == [5, 2]  # 5.25 / 1.75: the larger remainder rounds up
    assert sum(_shares(1001, cfg.sft.kwargs_mix)) == 1001


def test_demonstrations_come_from_each_variant_in_its_share():
    cfg = load_config("configs/long_horizon.yaml", [MIX])
    demos = expert_demonstrations(cfg, 4, error_rate=0.0, seed=0)
    lengths = [sum(len(m["content"] or "") for m in d.messages) for d in demos]
    assert max(lengths[:3]) * 2 < min(lengths[3:])  # 3 short-document episodes, then 1 long
    plain = expert_demonstrations(load_config("configs/long_horizon.yaml"), 4, error_rate=0.0,
                                  seed=0)  # fmt: skip
    assert [d.messages for d in plain[:3]] != [d.messages for d in demos[:3]]  # kwargs applied


def test_a_variant_with_a_kwarg_the_env_does_not_take_fails_naming_it():
    cfg = load_config("configs/long_horizon.yaml", ["sft.kwargs_mix=[{kwargs: {doc_tokenz: 3}}]"])
    with pytest.raises(ConfigError, match=r"sft\.kwargs_mix\.0\.kwargs\.doc_tokenz.*doc_tokens"):
        check_env(cfg)


def test_a_mix_of_variants_groups_batches_by_length(tmp_path):
    from trl import SFTConfig

    from rl.sft.warm_start import _sft_args

    mixed = _sft_args(load_config("configs/long_horizon.yaml", [MIX]), tmp_path, 10, SFTConfig)
    plain = _sft_args(load_config("configs/long_horizon.yaml"), tmp_path, 10, SFTConfig)
    assert mixed.train_sampling_strategy == "group_by_length"
    assert plain.train_sampling_strategy == "random"


def test_copy_rehearsal_examples_use_ordinary_tokens_and_train_only_the_copies():
    from rl.sft.warm_start import rehearsal_examples

    tokenizer = type("T", (), {"all_special_ids": [0, 1, 2], "__len__": lambda self: 40})()
    examples = rehearsal_examples(tokenizer, 5, seed=0)
    assert len(examples) == 5
    for example in examples:
        assert set(example) == {"input_ids", "assistant_masks"}
        assert min(example["input_ids"]) >= 3 and max(example["input_ids"]) < 40
        assert sum(example["assistant_masks"]) == 31  # the repeat of a 32-token span, less one
