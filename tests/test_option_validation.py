"""Every setting is checked where the user sets it -- a ``torch.compile`` option, ``config.patch``, the
``config.<name>`` attribute, an environment variable -- and a value not accepted raises one ValueError of one format:

    flashoverlap: <setting as written> = <value!r> is not accepted: <name> must be <what is accepted>

never a failure later inside the pass. CPU only."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from unittest import mock

import pytest
import torch

from flashoverlap_inductor import _inductor_compat as compat
from flashoverlap_inductor import backend, config


@pytest.fixture(autouse=True)
def _fresh_environment(monkeypatch):
    """Each test reads the environment afresh, without the caller's own FLASHOVERLAP_* variables (a device script
    sets FLASHOVERLAP_LIB), and leaves it read afresh (its variables undone)."""
    for var in config.ENV:
        monkeypatch.delenv(var, raising=False)
    config.reload_environment()
    yield
    monkeypatch.undo()
    config.reload_environment()


def via_options(**ours):
    """What the backend does with ``options={"flashoverlap.<name>": value}``."""
    ours, _ = backend.inductor_patches(None, {config.OPTION_PREFIX + k: v for k, v in ours.items()})
    return config.current().replace(**ours)


def via_patch(**changes):
    with config.patch(**changes) as settings:
        return settings


def via_env(monkeypatch, **variables):
    for var, value in variables.items():
        monkeypatch.setenv(var, value)
    config.reload_environment()
    return config.current()


def rejected(call, where, value, *accepted):
    """The message of the ValueError ``call()`` raises: it names ``where``, ``value`` and each of ``accepted``."""
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"flashoverlap: {where} = {value!r} is not accepted: "), message
    for text in accepted:
        assert text in message, (text, message)
    return message


def three_ways(monkeypatch, name, value, *accepted):
    """``name = value`` is rejected as an option and through ``patch``, each message naming the setting as written
    there; the settings are unchanged afterwards."""
    before = config.current()
    rejected(lambda: via_options(**{name: value}), f"flashoverlap.{name}", value, *accepted)
    rejected(lambda: via_patch(**{name: value}), name, value, *accepted)
    assert config.current() == before


# --------------------------------------------------------------------------------------------- collectives


def test_collectives_string_is_one_name_or_a_comma_separated_list(monkeypatch):
    for via in (via_options, via_patch):
        assert via(collectives="all_reduce").collectives == ("all_reduce",)  # once: its characters
        assert via(collectives="all_reduce, reduce_scatter").collectives == ("all_reduce", "reduce_scatter")
        assert via(collectives=["all_to_all"]).collectives == ("all_to_all",)
        assert via(collectives={"reduce_scatter", "all_reduce"}).collectives == ("all_reduce", "reduce_scatter")
    names = "collectives must be a name, a comma-separated string or a list of names from 'all_reduce', " \
            "'reduce_scatter', 'all_to_all', 'all_gather'"
    three_ways(monkeypatch, "collectives", 3, names)  # was: TypeError: 'int' object is not iterable
    three_ways(monkeypatch, "collectives", "all_reduce,broadcast", names, "(not among them: 'broadcast')")
    three_ways(monkeypatch, "collectives", ["broadcast"], names, "(not among them: 'broadcast')")
    assert config.Settings(collectives="all_reduce").collectives == ("all_reduce",)  # built directly too


# --------------------------------------------------------------------------------------------- numbers


def test_ints_are_checked_when_set(monkeypatch):
    three_ways(monkeypatch, "min_rows", "abc", "min_rows must be an int >= 0")  # was: accepted, failed in the pass
    three_ways(monkeypatch, "min_rows", -1, "min_rows must be an int >= 0")
    three_ways(monkeypatch, "min_rows", 1.5, "min_rows must be an int >= 0")
    three_ways(monkeypatch, "min_rows", True, "min_rows must be an int >= 0")
    three_ways(monkeypatch, "all_to_all_default_groups", 0, "all_to_all_default_groups must be an int >= 1")
    three_ways(monkeypatch, "swizzle", "eight", "swizzle must be an int >= 1")
    three_ways(monkeypatch, "ring_rounds", 17, "ring_rounds must be an int in 1 .. 16")
    three_ways(monkeypatch, "sm_reserve", -1, "sm_reserve must be an int >= 0, or None")
    assert via_options(min_rows="256").min_rows == 256  # an int string is read as the int
    assert via_patch(swizzle=" 8 ").tuning.swizzle == 8 and via_patch(sm_reserve="none").tuning.sm_reserve is None


def test_floats_are_checked_when_set(monkeypatch):
    fraction = "min_gain_fraction must be a finite number in [0, 1)"
    for bad in ("abc", 1.0, -0.1, float("nan"), True):
        three_ways(monkeypatch, "min_gain_fraction", bad, fraction)
    timeout = "wait_timeout_ms must be a finite number in (0, 604800000] ms"
    for bad in (0, -1, float("inf"), 1e13, "soon"):
        three_ways(monkeypatch, "wait_timeout_ms", bad, timeout, "or None / 'none' / 'group'")
    assert via_options(min_gain_fraction="0.5").min_gain_fraction == 0.5
    assert via_patch(wait_timeout_ms=30000).wait_timeout_ms == 30000.0
    assert via_options(wait_timeout_ms="group").wait_timeout_ms is None


def test_a_bad_number_never_reaches_the_pass():
    """Was: ``flashoverlap.min_rows="abc"`` compiled, and the pass logged skip:internal_error. Now the backend
    raises before anything is compiled."""
    compile_fx = mock.Mock()
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with mock.patch.object(compat, "compile_fx", compile_fx):
        rejected(lambda: backend.flashoverlap_backend(gm, [torch.randn(2)], options={"flashoverlap.min_rows": "abc"}),
                 "flashoverlap.min_rows", "abc", "min_rows must be an int >= 0")
    compile_fx.assert_not_called()


# --------------------------------------------------------------------------------------------- choices, names, paths


def test_choices_are_checked_when_set(monkeypatch):
    for name, bad, accepted in (("fuse", "sometimes", "fuse must be one of 'auto', 'always', 'never'"),
                                ("fuse", True, "fuse must be one of 'auto', 'always', 'never'"),
                                ("transport", "ib", "transport must be one of 'peer', 'nccl'"),
                                ("ring", "on", "ring must be one of 'off', 'wide', 'all'"),
                                ("gemm_grid", "grid", "gemm_grid must be one of 'tiles', 'persistent', or None"),
                                ("row_order", "stage", "row_order must be one of 'schedule', 'gather', or None")):
        three_ways(monkeypatch, name, bad, accepted)
    assert via_options(fuse=" Always ").fuse == "always"


def test_dtypes_and_experiments_are_checked_when_set(monkeypatch):
    dtypes = "dtypes must be a name, a comma-separated string or a list of names from 'bfloat16', 'float16', " \
             "'float32'"
    three_ways(monkeypatch, "dtypes", ["bf16"], dtypes, "(not among them: 'bf16')")  # was: accepted, never matched
    three_ways(monkeypatch, "dtypes", "float64", dtypes)  # was: accepted; the cost model knows no float64
    assert via_options(dtypes=[torch.bfloat16, "torch.float16"]).dtypes == ("bfloat16", "float16")
    experiments = "experiments must be a name, a comma-separated string or a list of names from 'single_group'"
    three_ways(monkeypatch, "experiments", "nope", experiments, "(not among them: 'nope')")
    three_ways(monkeypatch, "experiments", 3, experiments)  # was: TypeError: 'int' object is not iterable
    assert via_patch(experiments="single_group").experiments == frozenset({"single_group"})


def test_paths_are_checked_for_their_type(monkeypatch):
    three_ways(monkeypatch, "library", 3, "library must be a path (str or os.PathLike",
               "whether it exists is checked when the library is loaded", "or None")
    three_ways(monkeypatch, "config_dir", b"configs", "config_dir must be a path (str or os.PathLike",
               "whether it exists is checked when a data file is read")
    three_ways(monkeypatch, "peer_kernel", 7, "peer_kernel must be a GEMM configuration name (a str), or None")
    assert via_options(library=pathlib.Path("/no/such/lib.so")).library == "/no/such/lib.so"  # checked at load


# --------------------------------------------------------------------------------------------- unknown names


def test_an_unknown_name_names_the_close_match_and_all_accepted_names(monkeypatch):
    every_option = ", ".join("flashoverlap." + n for n in config.NAMES)
    rejected(lambda: via_options(fuze="always"), "flashoverlap.fuze", "always",
             "unknown option 'flashoverlap.fuze' (did you mean 'flashoverlap.fuse'?)", every_option)
    message = rejected(lambda: via_options(nope=1), "flashoverlap.nope", 1, "unknown option 'flashoverlap.nope'")
    assert "did you mean" not in message
    rejected(lambda: via_patch(ring_round=3), "ring_round", 3, "unknown setting 'ring_round' (did you mean "
             "'ring_rounds'?)", ", ".join(config.NAMES))
    rejected(lambda: via_options(tuning=3), "flashoverlap.tuning", 3, "tuning is set by its fields' names",
             "flashoverlap.swizzle")


# --------------------------------------------------------------------------------------------- the environment


def test_environment_variables_are_checked_when_first_read(monkeypatch):
    for var, value, accepted in (("FLASHOVERLAP_FUSE", "sometimes", "fuse must be one of 'auto', 'always', 'never'"),
                                 ("FLASHOVERLAP_RING_ROUNDS", "x", "ring_rounds must be an int in 1 .. 16"),
                                 ("FLASHOVERLAP_RING_ROUNDS", "256", "ring_rounds must be an int in 1 .. 16"),
                                 ("FLASHOVERLAP_TRANSPORT", "ib", "transport must be one of 'peer', 'nccl'"),
                                 ("FLASHOVERLAP_RING", "yes", "ring must be one of 'off', 'wide', 'all'")):
        rejected(functools.partial(via_env, monkeypatch, **{var: value}), var, value, accepted)
        rejected(functools.partial(via_options, fuse="never"), var, value, accepted)  # every later read, options or not
        monkeypatch.delenv(var)
        config.reload_environment()
        assert config.current() == config.Settings()  # a failed read is not kept


def test_every_bad_environment_variable_is_named_at_once(monkeypatch):
    message = rejected(lambda: via_env(monkeypatch, FLASHOVERLAP_FUSE="sometimes", FLASHOVERLAP_RING_ROUNDS="x"),
                       "FLASHOVERLAP_FUSE", "sometimes")
    assert "\nflashoverlap: FLASHOVERLAP_RING_ROUNDS = 'x' is not accepted: ring_rounds must be" in message


def test_good_environment_values_are_read_in_their_types(monkeypatch):
    s = via_env(monkeypatch, FLASHOVERLAP_FUSE=" Never", FLASHOVERLAP_RING_ROUNDS="3", FLASHOVERLAP_LIB="/x/lib.so")
    assert (s.fuse, s.tuning.ring_rounds, s.library) == ("never", 3, "/x/lib.so")


# --------------------------------------------------------------------------------------------- every field


WRONG_TYPES = (object(), b"bytes", 1 + 2j, [object()], {"a": 1})


def test_every_field_has_a_rule_and_rejects_a_wrong_type():
    """A new field of ``Settings`` or ``Tuning`` without a rule in ``config.RULES`` fails here."""
    tuning_fields = [f.name for f in dataclasses.fields(config.Tuning)]
    top_fields = [f.name for f in dataclasses.fields(config.Settings) if f.name != "tuning"]
    assert sorted(config.RULES) == sorted(tuning_fields + top_fields) == sorted(config.NAMES)
    for name in tuning_fields + top_fields:
        build = config.Tuning if name in tuning_fields else config.Settings
        for bad in WRONG_TYPES:
            rejected(functools.partial(build, **{name: bad}), name, bad, f"{name} must be ")  # built directly
            rejected(functools.partial(config.Settings().replace, **{name: bad}), name, bad, f"{name} must be ")
    for bad in WRONG_TYPES:
        rejected(functools.partial(config.Settings, tuning=bad), "tuning", bad, "tuning must be a config.Tuning")


def test_rules_are_idempotent_and_keys_of_valid_values_unchanged():
    """A checked value passes its rule unchanged (options are checked when split and again when applied), and
    equal settings given in different forms have one key."""
    for settings in (config.Settings(), config.Settings().replace(wait_timeout_ms=5, experiments="single_group",
                                                                  sm_reserve=3, library="/x.so")):
        for obj in (settings, settings.tuning):
            for f in dataclasses.fields(obj):
                if f.name == "tuning":
                    continue
                value = getattr(obj, f.name)
                assert config.RULES[f.name].check(f.name, f.name, value) == value, f.name
    s = config.Settings()
    assert s.replace(min_rows="512").key() == s.replace(min_rows=512).key()
    assert s.replace(wait_timeout_ms=30000).key() == s.replace(wait_timeout_ms="30000.0").key()
    assert s.replace(collectives="all_reduce,reduce_scatter").key() == \
        s.replace(collectives=("all_reduce", "reduce_scatter")).key()
    assert s.key() == config.from_key(s.key()).key() and "('min_rows', 256)" in s.key()
