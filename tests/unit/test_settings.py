"""SamplerSettings validation, derived facts, constructors, and SamplerState (pure, no torch)."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from dyngen_core.engine.settings import STAGE_ORDER, SamplerSettings, SamplerState
from dyngen_core.errors import JobError


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_k", -1, "top_k must be >= 0"),
        ("top_p", 1.5, "top_p must be in [0, 1]"),
        ("min_p", -0.01, "min_p must be in [0, 1]"),
        ("typical", 2.0, "typical must be in [0, 1]"),
        ("top_a", 1.1, "top_a must be in [0, 1]"),
        ("tfs", -1.0, "tfs must be in [0, 1]"),
        ("temp_exponent", 0.0, "temp_exponent must be > 0"),
        ("token_repetition_penalty", 0.0, "token_repetition_penalty must be > 0"),
        ("token_repetition_range", 0, "token_repetition_range must be -1"),
        ("token_repetition_range", -5, "token_repetition_range must be -1"),
        ("token_repetition_decay", -1, "token_repetition_decay must be >= 0"),
        ("dry_multiplier", -1.0, "dry_multiplier must be >= 0"),
        ("dry_base", 0.5, "dry_base must be >= 1"),
        ("dry_allowed_length", 0, "dry_allowed_length must be >= 1"),
        ("dry_max_ngram", 0, "dry_max_ngram must be >= 1"),
        ("xtc_probability", 1.2, "xtc_probability must be in [0, 1]"),
        ("mirostat_tau", 0.0, "mirostat_tau must be > 0"),
        ("mirostat_eta", -0.1, "mirostat_eta must be > 0"),
        ("token_bias", {-3: 1.0}, "token_bias keys must be token ids >= 0"),
        ("banned_tokens", (4, -1), "banned_tokens must be token ids >= 0"),
        ("dry_sequence_breakers", ("",), "dry_sequence_breakers holds non-empty strings"),
    ],
)
def test_out_of_range_values_name_the_field_and_range(field: str, value: Any,
                                                       expected: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplerSettings(**{field: value})
    message = str(info.value)
    assert expected in message
    assert f"got {value!r}" in message or field in ("token_bias", "banned_tokens",
                                                    "dry_sequence_breakers")


def test_non_finite_and_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="temperature"):
        SamplerSettings(temperature=math.nan)
    with pytest.raises(ValidationError, match="tempreature"):
        SamplerSettings(tempreature=0.5)  # type: ignore[call-arg]


def test_settings_are_frozen() -> None:
    settings = SamplerSettings(temperature=0.7)
    with pytest.raises(ValidationError, match="frozen"):
        settings.temperature = 0.2


def test_settings_are_hashable_and_compare_by_value() -> None:
    a = SamplerSettings(token_bias={3: 1.0, 1: -2.0}, top_p=0.9)
    b = SamplerSettings(token_bias={1: -2.0, 3: 1.0}, top_p=0.9)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, SamplerSettings()}) == 2


def test_defaults_are_neutral() -> None:
    settings = SamplerSettings()
    assert settings.active_stages() == frozenset()
    assert not settings.is_greedy
    assert settings.temperature == 1.0 and settings.top_p == 1.0 and settings.top_k == 0


def test_greedy_keeps_only_logit_edits() -> None:
    greedy = SamplerSettings.greedy(token_repetition_penalty=1.1, top_p=0.5, mirostat=True)
    assert greedy.is_greedy and greedy.temperature == 0.0
    assert greedy.active_stages() == {"penalties"}
    assert SamplerSettings(top_k=1, temperature=0.8).is_greedy


def test_active_stages_follow_settings() -> None:
    settings = SamplerSettings(
        temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, typical=0.9, tfs=0.95, top_a=0.2,
        xtc_probability=0.5, mirostat=True, dry_multiplier=0.8, token_presence_penalty=0.1,
        token_bias={5: 1.0},
    )
    assert settings.active_stages() == set(STAGE_ORDER) - {"temperature_last"}
    last = SamplerSettings(temperature=0.8, temperature_last=True)
    assert last.active_stages() == {"temperature_last"}
    assert SamplerSettings(min_temp=0.5, max_temp=1.5).active_stages() == {"temperature"}
    assert SamplerSettings(top_p=0.0, typical=1.0, tfs=1.0).active_stages() == frozenset()
    assert SamplerSettings(banned_tokens=(3,)).active_stages() == {"bias"}


def test_banned_tokens_are_sorted_and_unique() -> None:
    assert SamplerSettings(banned_tokens=(9, 2, 9)).banned_tokens == (2, 9)


def test_check_token_ids_names_the_field() -> None:
    SamplerSettings(token_bias={9: 1.0}).check_token_ids(10)
    with pytest.raises(JobError, match=r"token_bias holds token ids \[10\]"):
        SamplerSettings(token_bias={10: 1.0}).check_token_ids(10)
    with pytest.raises(JobError, match="banned_tokens"):
        SamplerSettings(banned_tokens=(3, 50)).check_token_ids(10)
    with pytest.raises(JobError, match="dry_sequence_breakers"):
        SamplerSettings(dry_sequence_breakers=("\n", 12)).check_token_ids(10)


def test_presets() -> None:
    assert SamplerSettings.preset("greedy").is_greedy
    balanced = SamplerSettings.preset("balanced", top_p=0.8)
    assert balanced.temperature == 0.7 and balanced.top_p == 0.8
    assert "dry" in SamplerSettings.preset("creative").active_stages()
    with pytest.raises(ValueError, match="unknown preset 'wild'.*balanced"):
        SamplerSettings.preset("wild")


def test_from_generation_config_maps_hf_keys() -> None:
    settings = SamplerSettings.from_generation_config({
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.02,
        "typical_p": 0.95, "repetition_penalty": 1.1, "bos_token_id": 1, "eos_token_id": [2],
    })
    assert (settings.temperature, settings.top_p, settings.top_k, settings.min_p,
            settings.typical, settings.token_repetition_penalty) == (0.6, 0.9, 20, 0.02, 0.95, 1.1)
    assert SamplerSettings.from_generation_config({}) == SamplerSettings()
    assert SamplerSettings.from_generation_config({"top_k": None}) == SamplerSettings()


def test_from_generation_config_greedy_cases() -> None:
    greedy = SamplerSettings.from_generation_config(
        {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.2})
    assert greedy.is_greedy and greedy.top_p == 1.0
    assert greedy.token_repetition_penalty == 1.2
    assert SamplerSettings.from_generation_config({"temperature": 0.0}).is_greedy
    # do_sample absent: the sampling keys that are present express the intent
    assert not SamplerSettings.from_generation_config({"temperature": 0.6}).is_greedy


def test_from_generation_config_rejects_bad_values() -> None:
    with pytest.raises(ValidationError, match="top_p must be in"):
        SamplerSettings.from_generation_config({"top_p": 3.0})


def test_sampler_state_mirostat_update_and_rollback() -> None:
    settings = SamplerSettings(mirostat=True, mirostat_tau=3.0, mirostat_eta=0.5)
    state = SamplerState()
    assert state.current_mu(settings) == 6.0
    state.record_token(settings, 0.25)  # surprise 2 bits: mu = 6 - 0.5 * (2 - 3)
    assert state.mirostat_mu == pytest.approx(6.5)
    state.record_token(settings, 1 / 32)  # surprise 5 bits: mu = 6.5 - 0.5 * (5 - 3)
    assert state.mirostat_mu == pytest.approx(5.5)
    state.rollback(1)
    assert state.mirostat_mu == pytest.approx(6.5)
    state.rollback(5)
    assert state.mirostat_mu is None and state.current_mu(settings) == 6.0


def test_sampler_state_ignores_non_mirostat_settings() -> None:
    state = SamplerState()
    state.record_token(SamplerSettings(), 0.5)
    assert state.mirostat_mu is None


def test_settings_and_constraint_specs_do_not_import_torch() -> None:
    code = ("import sys, dyngen_core.engine.settings, dyngen_core.text.constraints; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
