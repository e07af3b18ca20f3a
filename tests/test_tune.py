"""The tile-schedule tuner (python -m ptxattn tune) and its tables (launchers/tune_table):
buckets, the lookup order, what the launcher builds from a table, the shipped table against the
kernels CI compiles, pruning, the command line (a dry run compiles nothing), and (on a GPU) a
small tuning run."""

import dataclasses
import json

import pytest

from ptxattn import runtime
from ptxattn.launchers import hopper_forward as hopper, tune_table
from ptxattn.launchers.hopper_forward import FP8, Schedule
from ptxattn.tools import tune
from test_doctor import driver  # noqa: F401  (a fixture: the NVIDIA driver stood in for)


def _entry(head_dim, causal, bucket, schedule, family="hopper", dtype="bfloat16"):
    return {"family": family, "dtype": dtype, "head_dim": head_dim, "causal": causal,
            "bucket": bucket, "schedule": dataclasses.asdict(schedule)}


def _write(path, entries, arch="sm_90a"):
    tune_table.write(path, {"version": tune_table.VERSION, "arch": arch, "device": None,
                            "measured": False, "command": "test", "entries": entries})


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """Empty shipped and user tables in tmp_path, no PTXATTN_TUNE_TABLE, and the per-process
    cache of tables cleared before and after."""
    monkeypatch.setattr(tune_table, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("PTXATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(tune_table.ENV_VAR, raising=False)
    tune_table._tables.cache_clear()
    yield tmp_path
    tune_table._tables.cache_clear()


def _reread():
    tune_table._tables.cache_clear()


A = Schedule(112, 2, persistent=True, l2_sections=False, stale_max_first=True)
B = Schedule(144, 2, persistent=False, l2_sections=True)
C = Schedule(96, 3, persistent=True, l2_sections=False)
D = Schedule(80, 2, persistent=True, l2_sections=True)


# ---------------------------------------------------------------------------------------------
# Buckets and lookup


@pytest.mark.parametrize("seqlen_k, name", [
    (1, "short"), (1024, "short"), (1025, "medium"), (4096, "medium"), (4097, "long"),
    (1 << 20, "long"), (None, tune_table.DEFAULT_BUCKET)])
def test_bucket_boundaries(seqlen_k, name):
    assert tune_table.bucket(seqlen_k) == name


def test_lookup_order_env_then_user_then_shipped_then_builtin(tables, monkeypatch):
    _write(tune_table.shipped_path("sm_90a"), [_entry(128, False, "medium", A),
                                               _entry(128, False, "long", B)])
    _write(tune_table.user_path("sm_90a"), [_entry(128, False, "medium", C)])
    named = tables / "mine.json"
    _write(named, [_entry(128, False, "medium", D)])
    monkeypatch.setenv(tune_table.ENV_VAR, str(named))
    _reread()

    def block_n(seqlen_k):
        return hopper.variant("bfloat16", 128, False, seqlen_k=seqlen_k).block_n

    assert block_n(2048) == D.block_n  # PTXATTN_TUNE_TABLE
    assert block_n(8192) == B.block_n  # not in the first two: the shipped table
    assert block_n(512) == hopper.SCHEDULES[128, False].block_n  # in none: built in
    assert block_n(None) == D.block_n  # no shape: the default bucket
    monkeypatch.delenv(tune_table.ENV_VAR)
    _reread()
    assert block_n(2048) == C.block_n  # the user's
    tune_table.user_path("sm_90a").unlink()
    _reread()
    assert block_n(2048) == A.block_n  # the shipped one
    # other keys are untouched
    assert hopper.variant("float16", 128, False, seqlen_k=2048).block_n == 128
    assert hopper.variant("bfloat16", 128, True, seqlen_k=2048).block_n == 128


def test_tables_of_another_arch_are_not_read(tables, monkeypatch):
    named = tables / "other.json"
    _write(named, [_entry(128, False, "medium", D)], arch="sm_100a")
    monkeypatch.setenv(tune_table.ENV_VAR, str(named))
    _reread()
    assert hopper.variant("bfloat16", 128, False).block_n == hopper.SCHEDULES[128, False].block_n


def test_tables_are_read_once_per_process(tables):
    path = tune_table.shipped_path("sm_90a")
    _write(path, [_entry(128, False, "medium", A)])
    _reread()
    assert hopper.variant("bfloat16", 128, False).block_n == A.block_n
    _write(path, [_entry(128, False, "medium", C)])
    assert hopper.variant("bfloat16", 128, False).block_n == A.block_n
    _reread()
    assert hopper.variant("bfloat16", 128, False).block_n == C.block_n


def test_the_whole_schedule_comes_from_the_table_and_explicit_choices_win(tables):
    tuned = Schedule(96, 3, persistent=False, l2_sections=True, consumers=2,
                     stale_max_first=True)
    _write(tune_table.shipped_path("sm_90a"), [_entry(128, True, "long", tuned)])
    _reread()
    v = hopper.variant("bfloat16", 128, True, seqlen_k=16384)
    assert (v.block_n, v.stages, v.consumers, v.stale_max_first) == (96, 3, 2, True)
    assert hopper._schedule("bfloat16", 128, True, 16384, False) == tuned  # grid fields too
    v = hopper.variant("bfloat16", 128, True, (64, 2), seqlen_k=16384, stale_max_first=False)
    assert (v.block_n, v.stages, v.stale_max_first) == (64, 2, False)


def test_the_serving_build_keeps_its_own_schedules(tables):
    _write(tune_table.shipped_path("sm_90a"), [_entry(64, False, b, A)
                                               for b in tune_table.BUCKET_NAMES])
    _reread()
    serving = hopper.SCHEDULES_SERVING[64, False]
    v = hopper.variant("bfloat16", 64, False, serving=True, seqlen_k=2048)
    assert (v.block_n, v.consumers) == (serving.block_n, serving.consumers)


def test_fp8_per_block_k_descales_take_tiles_dividing_128_of_the_tuned_schedule(tables):
    fp8_192 = Schedule(192, 2, persistent=True, l2_sections=False, consumers=2)
    _write(tune_table.shipped_path("sm_90a"),
           [_entry(64, False, "medium", fp8_192, "hopper-fp8", "e4m3")])
    _reread()
    schedule = hopper._schedule(FP8, 64, False, 2048, False)
    assert schedule == fp8_192
    assert hopper._fp8_key_block_scaled_tiles(schedule, 64) == hopper.FP8_KEY_BLOCK_SCALED_TILES[64]
    assert hopper._fp8_key_block_scaled_tiles(hopper.SCHEDULES_FP8[64, False], 64) is None


def test_a_malformed_table_names_its_file(tables, monkeypatch):
    named = tables / "bad.json"
    monkeypatch.setenv(tune_table.ENV_VAR, str(named))
    named.write_text("{not json")
    _reread()
    with pytest.raises(ValueError, match=r"bad.json: cannot be read"):
        hopper.variant("bfloat16", 128, False)
    named.write_text(json.dumps({"version": 0, "arch": "sm_90a", "entries": []}))
    _reread()
    with pytest.raises(ValueError, match=r"bad.json: version 0, this ptxattn reads version 1; "
                                         r"write a new one with python -m ptxattn[ .]tune"):
        hopper.variant("bfloat16", 128, False)
    with pytest.raises(ValueError, match="unknown bucket"):
        _write(named, [_entry(128, False, "huge", A)])


def test_a_tune_table_variable_naming_no_file_is_an_error(tables, monkeypatch):
    monkeypatch.setenv(tune_table.ENV_VAR, str(tables / "typo.json"))
    _reread()
    with pytest.raises(ValueError, match=r"PTXATTN_TUNE_TABLE = .*typo.json.* names no file"):
        hopper.variant("bfloat16", 128, False)


def test_a_user_table_this_ptxattn_cannot_read_is_skipped_with_a_warning(tables):
    """Else a table of an older format would block every call, and the tuner that rewrites it."""
    _write(tune_table.shipped_path("sm_90a"), [_entry(128, False, "medium", A)])
    user = tune_table.user_path("sm_90a")
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text(json.dumps({"version": 0, "arch": "sm_90a", "entries": []}))
    _reread()
    with pytest.warns(RuntimeWarning, match=r"version 0.*skipped"):
        assert hopper.variant("bfloat16", 128, False).block_n == A.block_n


@pytest.mark.parametrize("schedule, message", [
    ({**dataclasses.asdict(A), "warps": 4}, "unexpected keyword argument 'warps'"),
    (dataclasses.asdict(Schedule(192, 3, persistent=True, l2_sections=False)),
     "needs 3[0-9]{5} bytes of shared memory"),
])
def test_a_table_schedule_that_cannot_run_is_an_error_naming_the_tables(tables, monkeypatch,
                                                                        schedule, message):
    named = tables / "mine.json"
    _write(named, [dict(_entry(128, False, "medium", A), schedule=schedule)])
    monkeypatch.setenv(tune_table.ENV_VAR, str(named))
    _reread()
    with pytest.raises(ValueError, match=rf"{message}.*python -m ptxattn[ .]tune"):
        hopper.variant("bfloat16", 128, False)


# ---------------------------------------------------------------------------------------------
# The shipped table and the variants CI compiles


def _entry_specs(entry) -> list[runtime.KernelSpec]:
    schedule = Schedule(**entry["schedule"])
    head_dim, causal = entry["head_dim"], entry["causal"]
    if entry["family"] == "hopper":
        return [hopper.spec(entry["dtype"], head_dim, causal, schedule=schedule)]
    tiles = hopper._fp8_key_block_scaled_tiles(schedule, head_dim)
    return [hopper.spec(FP8, head_dim, causal, t, out_dtype=out, schedule=schedule)
            for out in hopper.DTYPES for t in dict.fromkeys([None, tiles])]


def test_every_shipped_entry_is_a_variant_ci_compiles_within_the_budgets():
    table = tune_table.read(tune_table.shipped_path("sm_90a"))
    assert table["arch"] == "sm_90a"
    keys = [tune_table.entry_key(e) for e in table["entries"]]
    assert len(keys) == len(set(keys))
    shipped = set(hopper.variants())
    for entry in table["entries"]:
        assert (entry["family"], entry["dtype"]) in {hopper.tune_key(d)
                                                     for d in (*hopper.DTYPES, FP8)}
        assert entry["head_dim"] in hopper.HEAD_DIMS
        for spec in _entry_specs(entry):
            assert spec in shipped, f"{spec.name} of {entry} is not in hopper.variants()"
            assert spec.smem_bytes <= hopper.SMEM_LIMIT
        target = tune.Target(FP8 if entry["family"] == "hopper-fp8" else entry["dtype"],
                             entry["head_dim"], entry["causal"])
        assert tune.cpu_problem(target, Schedule(**entry["schedule"])) is None


def test_variants_are_unchanged_by_a_table_of_the_builtin_schedules(tables):
    no_table = hopper.variants()
    entries = [_entry(head_dim, causal, bucket, schedule, *hopper.tune_key(dtype))
               for dtype in (*hopper.DTYPES, FP8)
               for (head_dim, causal), schedule in
               (hopper.SCHEDULES_FP8 if dtype == FP8 else hopper.SCHEDULES).items()
               for bucket in tune_table.BUCKET_NAMES]
    _write(tune_table.shipped_path("sm_90a"), entries)
    assert hopper.variants() == no_table
    assert len(set(no_table)) == len(no_table)


def test_variants_add_what_the_shipped_table_reaches_once(tables):
    no_table = hopper.variants()
    tuned = Schedule(112, 2, persistent=True, l2_sections=False, stale_max_first=True)
    _write(tune_table.shipped_path("sm_90a"), [_entry(128, False, b, tuned)
                                               for b in ("short", "long")])
    added = [spec for spec in hopper.variants() if spec not in no_table]
    assert [spec.name for spec in added] == ["fwd_sm90_bfloat16_d128_n112_s2_smf"]
    # every bucket tuned: the built-in schedule is reached by no call and not compiled
    _write(tune_table.shipped_path("sm_90a"), [_entry(128, False, b, tuned)
                                               for b in tune_table.BUCKET_NAMES])
    names = [spec.name for spec in hopper.variants()]
    assert "fwd_sm90_bfloat16_d128_n128_s2_smf" not in names
    assert "fwd_sm90_float16_d128_n128_s2_smf" in names


# ---------------------------------------------------------------------------------------------
# Candidates and pruning


def test_register_estimate_counts_as_the_kernel_does():
    # head_dim 64, three consumers: 96 (S) + 32 (O) + 32 (P) of 160 - 32
    assert tune.register_estimate(tune.Target("bfloat16", 64, False),
                                  hopper.SCHEDULES[64, False]) == (128, 128)
    # FP8 head_dim 128, 192 keys, Q in registers: 96 + 64 + 24 + 16 = 200 -> producer at 40
    assert tune.register_estimate(tune.Target(FP8, 128, False),
                                  hopper.SCHEDULES_FP8[128, False]) == (200, 208)


@pytest.mark.parametrize("dtype", [*hopper.DTYPES, FP8])
def test_builtin_schedules_pass_the_accounting(dtype):
    schedules = hopper.SCHEDULES_FP8 if dtype == FP8 else hopper.SCHEDULES
    for (head_dim, causal), schedule in schedules.items():
        assert tune.cpu_problem(tune.Target(dtype, head_dim, causal), schedule) is None


def test_pruning_names_what_does_not_fit():
    bf16 = tune.Target("bfloat16", 128, False)
    assert tune.cpu_problem(bf16, Schedule(192, 3, True, False)).startswith("shared memory")
    assert tune.cpu_problem(bf16, Schedule(96, 2, True, False, consumers=3)).startswith(
        "registers: 136 in fragments > 128")
    fp8 = tune.Target(FP8, 256, False)
    assert tune.cpu_problem(fp8, Schedule(64, 3, True, False, q_in_registers=True)).startswith(
        "registers: 232 in fragments > 208")


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", FP8])
def test_candidates_start_with_the_builtin_schedule(dtype, quick):
    for head_dim in hopper.FP8_HEAD_DIMS if dtype == FP8 else hopper.HEAD_DIMS:
        target = tune.Target(dtype, head_dim, True)
        found = tune.candidates(target, quick)
        assert found[0] == target.builtin
        assert len(set(found)) == len(found)
        for s in found:
            assert s.block_n in tune.BLOCK_N[target.fp8]
            assert not (s.stale_max_first and target.fp8)
            assert not (s.q_in_registers and not target.fp8)
            assert s.producer_regs in ((0,) + tune.PRODUCER_REGS if target.fp8 else (0,))
            assert s.intra_overlap or not s.stale_max_first
        if quick:  # the built-in schedule, one move of each field, the shipped buckets'
            assert len(tune._searched(target, quick)) <= 12
            assert len(found) <= 12 + len(tune_table.BUCKET_NAMES)


def test_fp8_register_splits_leave_the_consumers_different_counts():
    base = Schedule(128, 2, persistent=True, l2_sections=False, consumers=3)
    splits = tune.register_splits(tune.Target(FP8, 64, False), base)
    counts = [hopper.schedule_registers(64, s, True)[2] for s in splits]
    assert splits[0] == base
    assert counts == [152, 160]  # the kernel's own split (producer 56), then producer 32
    assert tune.register_splits(tune.Target("bfloat16", 64, False), base) == [base]


def test_a_register_split_of_its_own_is_an_fp8_variant_of_its_own():
    fp8 = Schedule(128, 3, persistent=True, l2_sections=False, consumers=3,
                   q_in_registers=True, producer_regs=32)
    spec = hopper.spec(FP8, 64, True, schedule=fp8)
    own = hopper.spec(FP8, 64, True, schedule=dataclasses.replace(fp8, producer_regs=0))
    assert spec.name == own.name.replace("_qr", "_qr_p32")
    assert ", 32, " in spec.entry and ", 0, " in own.entry
    assert runtime.compile(spec, "sm_90a").spill_bytes == 0
    with pytest.raises(ValueError, match="producer_regs is an FP8 schedule field"):
        hopper.spec("bfloat16", 64, True, schedule=dataclasses.replace(fp8, q_in_registers=False))


def test_asking_for_the_stale_max_softmax_runs_the_overlapped_mainloop(tables):
    """A tuned schedule may run key blocks in turn; a caller's stale_max_first=True (which the
    in-turn mainloop does not have) takes the overlapped one instead of failing."""
    in_turn = Schedule(256, 2, persistent=True, l2_sections=False, q_in_registers=True,
                       intra_overlap=False)
    _write(tune_table.shipped_path("sm_90a"),
           [_entry(64, False, "short", in_turn, family="hopper-fp8", dtype="e4m3")])
    assert not hopper.variant(FP8, 64, False, seqlen_k=512).intra_overlap
    assert hopper.variant(FP8, 64, False, seqlen_k=512, stale_max_first=True).intra_overlap
    with pytest.raises(ValueError, match="max pass only"):
        hopper.variant(FP8, 64, False, seqlen_k=512, stale_max_first=True, intra_overlap=False)


def test_schedules_differing_in_any_field_launch_differently():
    """The tuner times one launch per distinct set of overrides: a field the overrides left out
    would time another schedule's kernel under this one's name."""
    target = tune.Target(FP8, 64, False)
    shape = tune.bucket_shapes(64, "long")[0]
    base = Schedule(128, 2, persistent=True, l2_sections=False, consumers=3)
    changed = {"block_n": 64, "stages": 3, "persistent": False, "l2_sections": True,
               "consumers": 2, "stale_max_first": True, "q_in_registers": True,
               "producer_regs": 32, "intra_overlap": False}
    assert set(changed) == {f.name for f in dataclasses.fields(Schedule)}
    for field, value in changed.items():
        other = dataclasses.replace(base, **{field: value})
        assert (tune._launch_overrides(target, other, shape) !=
                tune._launch_overrides(target, base, shape)), field


# ---------------------------------------------------------------------------------------------
# The command line


def test_unknown_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        tune.main(["--dry-run", "--head-dims", "96"])
    assert "--head-dims: 96; choose from 64, 128, 192, 256" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--dry-run", "--buckets", "tiny"])


DRY_RUN = ["--dry-run", "--quick", "--head-dims", "256", "--no-causal", "--no-fp8", "--jobs", "0"]


def _no_compiling(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(runtime, "compile", refused)
    monkeypatch.setattr(tune.kernels, "for_each_spec", refused)


def _plan_lines(out: str) -> dict[str, str]:
    """A dry run's build lines: label -> kept or why dropped."""
    lines = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    return {line[:26].strip(): line[26:].strip() for line in lines}


def test_dry_run_prints_candidates_and_why_each_was_dropped(tables, capsys):
    if runtime.nvrtc_version() < (13, 5):
        pytest.skip("spills and registers need the ptxas report NVRTC 13.5 gives (as "
                    "test_kernels)")
    status = tune.main(DRY_RUN + ["--compile"])
    out, err = capsys.readouterr()
    assert status == 0
    assert "hopper bfloat16 d256 non-causal: 7 candidates in 5 builds" in out
    assert "n64 s2 c2 inturn" in out  # the intra-warpgroup overlap off
    assert "n64 s2 c2 (built-in)" in out and "kept: persistent, grid, persistent l2" in out
    assert "n64 s3 c2" in out and "shared memory 263" in out
    # what only compiling finds: the stale-max softmax spills at head_dim 256
    assert "spills" in _plan_lines(out)["n64 s2 c2 smf"]
    assert "compiling 8 kernels" in out and "compiled 8/8" in err  # the count, off a terminal
    assert not tune_table.user_path("sm_90a").exists()  # a dry run writes no table


def test_a_dry_run_compiles_nothing(tables, monkeypatch, capsys):
    """Every candidate and the accounting's reasons, without NVRTC (over every key, compiling
    is most of a quarter of an hour on 2 cores)."""
    _no_compiling(monkeypatch)
    assert tune.main(DRY_RUN) == 0
    out, err = capsys.readouterr()
    assert "hopper bfloat16 d256 non-causal: 7 candidates in 5 builds, 6 candidates kept" in out
    builds = _plan_lines(out)
    assert builds["n64 s3 c2"].startswith("shared memory 263")
    assert builds["n64 s2 c2 (built-in)"] == "kept: persistent, grid, persistent l2"
    assert builds["n64 s2 c2 smf"] == "kept: persistent"  # its spills are --compile's to find
    assert "not compiled: the 8 kernels of the builds kept (--compile compiles them" in out
    assert "compiled" not in err
    assert not tune_table.user_path("sm_90a").exists()


def test_a_dry_run_over_every_key_compiles_nothing(tables, monkeypatch, capsys):
    _no_compiling(monkeypatch)
    assert tune.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    # (4 16-bit head dims + 3 FP8 ones) x causal or not
    assert out.count(" candidates in ") == 2 * (len(hopper.HEAD_DIMS) + len(hopper.FP8_HEAD_DIMS))
    assert "registers: " in out and "shared memory " in out


def test_dry_run_with_compile_drops_what_the_kernels_checks_refuse(tables, monkeypatch, capsys):
    compiled = []

    def spilling(spec, arch):
        compiled.append(spec.name)
        return runtime.CompiledKernel(spec, arch, b"", runtime.PtxasReport(200, 64, 64, 0, 0),
                                      "")

    monkeypatch.setattr(runtime, "compile", spilling)
    assert tune.main(DRY_RUN + ["--compile"]) == 0
    out = capsys.readouterr().out
    assert len(set(compiled)) == 8  # every kernel of the 4 builds the accounting keeps
    assert "7 candidates in 5 builds, 0 candidates kept" in out
    builds = _plan_lines(out)
    assert builds["n64 s3 c2"].startswith("shared memory 263")  # not compiled: the CPU's cut
    assert "fwd_sm90_bfloat16_d256_n64_s2: spills 128 bytes" in builds["n64 s2 c2 (built-in)"]


def test_compile_goes_with_dry_run(capsys):
    with pytest.raises(SystemExit) as info:
        tune.main(["--compile"])
    assert info.value.code == 2
    assert "--compile goes with --dry-run" in capsys.readouterr().err


def test_without_a_gpu_tuning_says_why_before_compiling(tables, driver, monkeypatch, capsys):
    _no_compiling(monkeypatch)
    driver(None)
    assert tune.main(["--quick", "--head-dims", "64"]) == 2
    err = capsys.readouterr().err
    assert "no NVIDIA driver found" in err and "python -m ptxattn doctor" in err


# ---------------------------------------------------------------------------------------------
# On a GPU


@pytest.mark.gpu
def test_quick_tuning_of_one_key_writes_a_table_the_launcher_follows(tables, monkeypatch,
                                                                    capsys):
    output = tables / "tuned.json"
    status = tune.main(["--quick", "--head-dims", "128", "--no-causal", "--no-fp8",
                        "--buckets", "short", "--repeats", "3", "--output", str(output)])
    out = capsys.readouterr().out
    assert status == 0, out
    table = tune_table.read(output)
    assert table["measured"] and table["device"]
    by_dtype = {e["dtype"]: e for e in table["entries"]}
    assert set(by_dtype) == {"bfloat16", "float16"}
    bf16 = by_dtype["bfloat16"]
    assert (bf16["head_dim"], bf16["causal"], bf16["bucket"]) == (128, False, "short")
    assert bf16["tflops"] > 0 and bf16["builtin_tflops"] > 0 and bf16["margin"] is not None
    assert by_dtype["float16"]["schedule"] == bf16["schedule"]
    assert by_dtype["float16"]["measured_dtype"] == "bfloat16"
    assert "TFLOP/s" in out and "(built-in)" in out
    monkeypatch.setenv(tune_table.ENV_VAR, str(output))
    _reread()
    assert hopper._schedule("bfloat16", 128, False, 512, False) == Schedule(**bf16["schedule"])


@pytest.mark.gpu
def test_quick_tuning_of_an_fp8_key(tables, capsys):
    output = tables / "tuned.json"
    status = tune.main(["--quick", "--head-dims", "64", "--causal", "--fp8", "--buckets",
                        "short", "--repeats", "3", "--output", str(output)])
    assert status == 0, capsys.readouterr().out
    (entry,) = tune_table.read(output)["entries"]
    assert (entry["family"], entry["dtype"], entry["measured_dtype"]) == (
        "hopper-fp8", "e4m3", "e4m3")
    assert entry["tflops"] > 0


def test_the_shipped_schedules_are_always_candidates(tables):
    """A user's table is read before the shipped one: a run that never tried the shipped
    schedule could write a slower one over it."""
    far = Schedule(64, 4, persistent=False, l2_sections=True, consumers=2)
    _write(tune_table.shipped_path("sm_90a"), [_entry(128, True, "long", far)])
    target = tune.Target("bfloat16", 128, True)
    assert far not in tune._searched(target, quick=True)
    assert far in tune.candidates(target, quick=True)


def test_a_winner_within_min_gain_of_the_incumbent_leaves_it_in_place():
    means = {A: 100.0, B: 101.5, C: 90.0}
    assert tune.pick_winner(means, A, 0.02) == A
    assert tune.pick_winner(means, C, 0.02) == B
    assert tune.pick_winner(means, A, 0.01) == B
    assert tune.pick_winner(means, D, 0.02) == B  # an incumbent that did not run holds nothing


def test_the_written_table_s_schedules_are_the_incumbents_and_candidates(tables):
    """Tuning a table again starts from what it holds, so keys whose fastest moved within the
    noise keep their schedule (and compiled variant)."""
    output = tables / "mine.json"
    target = tune.Target("bfloat16", 128, True)
    assert tune.incumbents(target, output) == {}
    _write(output, [_entry(128, True, "long", D), _entry(128, False, "long", B),
                    _entry(128, True, "short", C, dtype="float16")])
    held = tune.incumbents(target, output)
    assert held == {"long": D}
    assert D in tune.candidates(target, quick=True, incumbents=held)
    assert tune.incumbents(target, tables / "absent.json") == {}
    _write(output, [_entry(128, True, "long", D)], arch="sm_100a")
    assert tune.incumbents(target, output) == {}
    unknown = _entry(128, True, "long", D)
    unknown["schedule"]["a_later_field"] = 1
    _write(output, [unknown, _entry(128, True, "medium", C)])
    assert tune.incumbents(target, output) == {"medium": C}


def test_a_narrowed_run_keeps_the_table_s_other_keys(tables):
    output = tables / "mine.json"
    _write(output, [_entry(128, False, "medium", A), _entry(64, False, "medium", B)])
    merged = tune.merged_entries(output, [_entry(128, False, "medium", C)])
    got = {tune_table.entry_key(e): e["schedule"] for e in merged}
    assert got == {("hopper", "bfloat16", 128, False, "medium"): dataclasses.asdict(C),
                   ("hopper", "bfloat16", 64, False, "medium"): dataclasses.asdict(B)}
    assert tune.merged_entries(tables / "absent.json", merged) == merged


def test_builtin_turns_every_table_off(tables, monkeypatch):
    _write(tune_table.shipped_path("sm_90a"), [_entry(128, False, "medium", A)])
    monkeypatch.setenv(tune_table.ENV_VAR, tune_table.BUILTIN_ONLY)
    _reread()
    assert hopper.variant("bfloat16", 128, False).block_n == hopper.SCHEDULES[128, False].block_n
