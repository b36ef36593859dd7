"""Bad input, table-driven: every mistake exits 2 with one line naming it, no traceback,
and nothing in the output folder changes.

Each :class:`Case` runs in-process through :func:`jaxpar.cli.main` (fast); a few run as
real ``python -m jaxpar.cli`` processes too, to show what a user sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import jaxpar.data.loader
from jaxpar.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.d_model=32", "model.n_layers=1", "model.d_ff=64", "train.seq_len=16",
         "train.global_batch=8", "train.steps=2", "data.max_bytes=100000"]
BASE = ["train", "--config", "configs/tiny.yaml", "--devices", "8"]
TRAIN = [*BASE, "--out", "{out}", *SMALL]
INSPECT = ["inspect", "--config", "configs/tiny.yaml", "--devices", "8", *SMALL]
PLAN = ["plan", "--model", "configs/tiny.yaml", "--chips", "cpu:8", "--global-batch", "8",
        "--seq", "128"]
LAUNCH = ["launch", "--processes", "2", "--devices-per-process", "4", "--"]
CHILD_BASE = ["train", "--config", "configs/tiny.yaml"]
CHILD = [*CHILD_BASE, "--out", "{out}", *SMALL]
BAD_YAML = "model:\n  d_model: 32\n  n_layers: [1, 2\ntrain:\n  steps: 2\n"

Setup = Callable[[Path], dict[str, str]]


@dataclass
class Case:
    """``argv`` (``{out}``, ``{tmp}`` and the setup's keys are filled in) must exit 2 with
    one stderr line that contains every string of ``culprits``."""

    name: str
    argv: list[str]
    culprits: tuple[str, ...]
    setup: Setup | None = None
    chunk: int | None = None  # jaxpar.data.loader.SCAN_CHUNK for this case
    xfail: str = ""  # a known library bug: the reason (strict xfail until it is fixed)


def write(name: str, content: bytes | str | np.ndarray | None = None, *,
          key: str = "file") -> Setup:
    """A setup that makes ``tmp/name`` (a folder when ``content`` is None)."""

    def setup(tmp: Path) -> dict[str, str]:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        elif isinstance(content, np.ndarray):
            np.save(path, content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)
        return {key: str(path)}

    return setup


def prior_run(tmp: Path) -> dict[str, str]:
    """An --out folder that already holds an earlier run's files (no checkpoints)."""
    out = tmp / "run"
    out.mkdir()
    (out / "config.yaml").write_text("train:\n  steps: 5\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n')
    return {}


def saved_run(tmp: Path) -> dict[str, str]:
    """A run folder with a (fake) checkpoint at step 5: what check_run_folder looks for."""
    prior_run(tmp)
    (tmp / "run" / "checkpoints" / "5").mkdir(parents=True)
    return {}


def late_bad_id(tmp: Path) -> dict[str, str]:
    tokens = np.ones(20_000, dtype=np.uint16)
    tokens[15_000] = 999  # far past the first SCAN_CHUNK (4096 here)
    return write("late.npy", tokens, key="data")(tmp)


def negative_ids(tmp: Path) -> dict[str, str]:
    tokens = np.arange(5_000, dtype=np.int32) % 200
    tokens[1_234] = -7
    return write("neg.npy", tokens, key="data")(tmp)


def tokenized(tmp: Path) -> dict[str, str]:
    """uint32 shards as ``jaxpar tokenize`` writes them, with their tokenize.json."""
    (tmp / "made").mkdir()
    (np.arange(4000) % 200 + 2).astype(np.uint32).tofile(tmp / "made" / "00000-a.bin")
    (tmp / "made" / "tokenize.json").write_text(json.dumps({
        "eos_id": 1, "token_dtype": "uint32", "vocab_size": 202, "complete": True,
        "shards": [{"shard": "00000-a.bin", "tokens": 4000}]}))
    return {}


NPY_2D = np.zeros((100, 100), dtype=np.int32)

CASES = [
    # --- config: ranges and types -------------------------------------------------------
    Case("lr_negative", [*TRAIN, "train.lr=-1"], ("train.lr=-1",)),
    Case("d_model_zero", [*TRAIN, "model.d_model=0"], ("model.d_model=0",)),
    Case("steps_negative", [*TRAIN, "train.steps=-3"], ("train.steps=-3",)),
    Case("holdout_1.5", [*TRAIN, "data.holdout_fraction=1.5"], ("data.holdout_fraction=1.5",)),
    Case("seq_len_zero", [*TRAIN, "train.seq_len=0"], ("train.seq_len=0",)),
    Case("n_layers_zero", [*TRAIN, "model.n_layers=0"], ("model.n_layers=0",)),
    Case("global_batch_zero", [*TRAIN, "train.global_batch=0"], ("train.global_batch=0",)),
    Case("log_every_zero", [*TRAIN, "train.log_every=0"], ("train.log_every=0",)),
    Case("grad_clip_nan", [*TRAIN, "train.grad_clip=.nan"], ("train.grad_clip=nan",)),
    Case("checkpoint_keep_zero", [*TRAIN, "checkpoint.keep=0"], ("checkpoint.keep=0",)),
    Case("unknown_key", [*TRAIN, "train.stepz=3"], ("train.stepz", "train.steps")),
    Case("wrong_type", [*TRAIN, "train.steps=abc"], ("train.steps", "abc")),
    Case("bool_garbage", [*TRAIN, "plan.strict=maybe"], ("plan.strict", "maybe")),
    Case("override_without_equals", [*TRAIN, "trainsteps"], ("trainsteps",)),
    Case("override_bad_yaml", [*TRAIN, "train.lr=[1"], ("train.lr=[1",)),
    Case("unknown_option", [*TRAIN, "--frobnicate"], ("--frobnicate",)),
    Case("zero_stage_5", [*TRAIN, "plan.zero_stage=5"], ("plan.zero_stage=5",)),
    Case("rules_unknown", [*TRAIN, "plan.rules=zigzag"], ("plan.rules", "zigzag")),
    Case("precision_garbage", [*TRAIN, "plan.precision=float99"], ("plan.precision", "float99")),
    Case("remat_unknown", [*TRAIN, "plan.remat=sometimes"], ("plan.remat", "sometimes")),
    Case("optimizer_unknown", [*TRAIN, "train.optimizer=adamz"], ("train.optimizer", "adamz")),
    Case("trainable_bad_regex", [*TRAIN, "train.trainable=a(b"], ("train.trainable", "a(b")),
    # a URL where a local folder is needed (it filled a local folder named s3:)
    Case("compile_cache_url", [*TRAIN, "train.compile_cache=s3://b/cache"],
         ("train.compile_cache 's3://b/cache'", "s3:// storage is not supported")),
    Case("loss_not_a_function", [*TRAIN, "train.loss=no way"], ("train.loss", "no way")),
    Case("lora_target_bad_regex", [*TRAIN, "lora.enabled=true", "lora.target=wq("],
         ("lora.target", "wq(")),
    Case("lora_rank_zero", [*TRAIN, "lora.enabled=true", "lora.rank=0"], ("lora.rank", "0")),
    Case("seq_len_over_max", [*TRAIN, "train.seq_len=512"],
         ("train.seq_len=512", "model.max_seq_len=256")),
    Case("eval_without_holdout", [*TRAIN, "train.eval_every=1", "data.holdout_fraction=0"],
         ("train.eval_every=1", "data.holdout_fraction=0")),
    Case("microbatches_indivisible", [*TRAIN, "plan.microbatches=3"],
         ("train.global_batch=8", "plan.microbatches=3")),
    Case("profile_steps_reversed", [*TRAIN, "train.profile_steps=[3,2]"],
         ("train.profile_steps", "3, 2")),
    Case("init_from_missing", [*TRAIN, "init_from={tmp}/nowhere"], ("init_from", "nowhere")),
    Case("init_from_hf_missing", [*TRAIN, "init_from=hf:{tmp}/nowhere"],
         ("init_from='hf:", "is not a Hugging Face model folder (no config.json)")),
    Case("rope_scaling_unknown", [*TRAIN, "model.rope_scaling=yarn"],
         ("model.rope_scaling='yarn': choose one of ['none', 'linear', 'llama3']",)),
    Case("sliding_window_negative", [*TRAIN, "model.sliding_window=-4"],
         ("model.sliding_window=-4",)),
    Case("mlp_activation_unknown", [*TRAIN, "model.mlp_activation=relu"],
         ("model.mlp_activation='relu'",)),
    Case("attention_unknown", [*TRAIN, "model.attention=flash"],
         ("model.attention='flash'", "chunked")),
    Case("loss_chunk_negative", [*TRAIN, "model.loss_chunk=-8"],
         ("model.loss_chunk=-8",)),
    Case("experts_indivisible", [*TRAIN, "mesh.expert=4", "mesh.data=2", "model.n_experts=6"],
         ("model.n_experts=6 is not divisible by mesh.expert=4",)),
    Case("experts_per_token_too_many", [*TRAIN, "model.n_experts=4",
                                        "model.experts_per_token=5"],
         ("model.experts_per_token=5", "model.n_experts=4")),
    Case("context_seq_indivisible", [*TRAIN, "mesh.context=4", "mesh.data=2",
                                     "train.seq_len=36"],
         ("train.seq_len=36", "mesh.context=4", "multiple of 8")),
    Case("context_attention_unknown", [*TRAIN, "plan.context_attention=ulysses"],
         ("plan.context_attention='ulysses'", "ring")),
    Case("experts_per_token_dense", [*TRAIN, "model.experts_per_token=7"],
         ("model.experts_per_token=7", "model.n_experts=0")),
    Case("dropless_on_expert_axis", [*TRAIN, "mesh.expert=4", "mesh.data=2",
                                     "model.n_experts=4", "model.expert_capacity=0"],
         ("model.expert_capacity=0", "mesh.expert=4")),
    Case("field_without_tokenizer", [*TRAIN, "data.field=body"],
         ("data.field='body'", "data.tokenizer")),
    Case("cudnn_on_cpu", [*TRAIN, "model.attention=cudnn"],
         ("model.attention='cudnn'", "cpu", "model.attention=auto")),
    Case("factory_logits_narrower_than_vocab",
         [*TRAIN, "mesh.data=8", "model.factory=tests.user_models:llama_like",
          "model.kwargs={{d: 32, heads: 4, kv_heads: 2, ff: 64}}"],
         ("model.vocab_size=256", "64 entries")),
    Case("prior_run_unknown_key", [*TRAIN, "model.d_modle=32"], ("model.d_modle",),
         setup=prior_run),
    # --- config files ---------------------------------------------------------------------
    Case("yaml_error_train", ["train", "--config", "{file}", "--out", "{out}"],
         ("bad.yaml:4:", "invalid YAML"), setup=write("bad.yaml", BAD_YAML)),
    Case("yaml_error_inspect", ["inspect", "--config", "{file}", "--devices", "8"],
         ("bad.yaml:4:", "invalid YAML"), setup=write("bad.yaml", BAD_YAML)),
    Case("config_missing", ["train", "--config", "{tmp}/nope.yaml", "--out", "{out}"],
         ("nope.yaml", "does not exist")),
    Case("config_is_folder", ["train", "--config", "{file}", "--out", "{out}"],
         ("conf.d", "is not a file"), setup=write("conf.d")),
    Case("config_not_mapping", ["train", "--config", "{file}", "--out", "{out}"],
         ("list.yaml", "mapping"), setup=write("list.yaml", "- 1\n- 2\n")),
    Case("config_section_not_mapping", ["train", "--config", "{file}", "--out", "{out}"],
         ("train", "mapping"), setup=write("sec.yaml", "train: 5\n")),
    # --- devices and layout ---------------------------------------------------------------
    Case("devices_zero", ["train", "--config", "configs/tiny.yaml", "--devices", "0"],
         ("--devices", "0")),
    Case("devices_not_a_number", ["train", "--devices", "eight"], ("--devices", "eight")),
    Case("batch_indivisible", [*TRAIN, "train.global_batch=30"],
         ("train.global_batch=30", "data-parallel size 8")),
    Case("mesh_needs_more_devices", [*TRAIN, "mesh.data=16"], ("needs 16 devices", "8")),
    Case("mesh_two_free_axes", [*TRAIN, "mesh.data=-1", "mesh.fsdp=-1"],
         ("mesh.data", "mesh.fsdp", "-1")),
    Case("mesh_axis_zero", [*TRAIN, "mesh.tensor=0"], ("mesh.tensor=0",)),
    Case("pipeline_layers_indivisible", [*TRAIN, "mesh.stage=2", "model.n_layers=3"],
         ("model.n_layers=3", "mesh.stage")),
    # 2 KV heads on 8-way tensor parallelism fall through to replicated; strict rules refuse.
    Case("strict_kv_heads_over_tensor",
         [*BASE, *SMALL, "mesh.tensor=8", "model.n_kv_heads=2", "plan.strict=true"],
         ("not divisible by mesh axes ('tensor',)",)),
    Case("strict_indivisible_vocab",
         [*TRAIN, "plan.strict=true", "model.vocab_size=257", "mesh.tensor=2"],
         ("model.vocab_size", "257")),
    Case("multiprocess_half_given", [*TRAIN, "--num-processes", "2"],
         ("--coordinator", "--process-id")),
    # --- run folders ----------------------------------------------------------------------
    Case("out_is_file", [*BASE, "--out", "{file}", *SMALL],
         ("--out", "taken.txt", "is a file"), setup=write("taken.txt", "x")),
    # "Not writable": tests run as root, which chmod does not stop (and /sys, /proc are
    # writable here), so the unwritable --out is a path under an existing file.
    Case("out_under_file", [*BASE, "--out", "{file}/run", *SMALL],
         ("--out", "blocker", "is a file"), setup=write("blocker", "x")),
    Case("fresh_run_over_checkpoints", TRAIN, ("checkpoints", "[5]", "--resume"),
         setup=saved_run),
    Case("resume_without_out", [*BASE, "--resume", *SMALL],
         ("--resume", "--out")),
    Case("profile_without_out", [*BASE, *SMALL, "train.profile_steps=[1,2]"],
         ("train.profile_steps", "--out")),
    # --- data -----------------------------------------------------------------------------
    Case("data_source_missing", [*TRAIN, "data.source={tmp}/corpus.txt"],
         ("data.source", "corpus.txt")),
    Case("npy_negative_id", [*TRAIN, "data.source={data}"],
         ("neg.npy", "token id -7", "position 1234"), setup=negative_ids),
    Case("npy_late_id_over_vocab", [*TRAIN, "data.source={data}"],
         ("late.npy", "token id 999", "position 15000", "model.vocab_size=256"),
         setup=late_bad_id, chunk=4096),
    Case("data_shorter_than_batch", [*TRAIN, "data.source={file}"],
         ("short.txt", "fewer than one batch"), setup=write("short.txt", "tiny corpus\n")),
    Case("bin_odd_length", [*TRAIN, "data.source={file}"], ("odd.bin", "1001 bytes"),
         setup=write("odd.bin", b"\x01" * 1001)),
    Case("data_empty_file", [*TRAIN, "data.source={file}"], ("empty.txt", "empty"),
         setup=write("empty.txt", b"")),
    Case("data_empty_folder", [*TRAIN, "data.source={file}"], ("corpus.d", "no files"),
         setup=write("corpus.d")),
    Case("npy_not_npy", [*TRAIN, "data.source={file}"], ("fake.npy", "not a .npy"),
         setup=write("fake.npy", b"just some text")),
    Case("npy_2d", [*TRAIN, "data.source={file}"], ("2d.npy", "1-D"),
         setup=write("2d.npy", NPY_2D)),
    Case("holdout_too_small", [*TRAIN, "data.source={file}", "train.eval_every=1",
                               "data.holdout_fraction=0.01"],
         ("held-out", "data.holdout_fraction=0.01"), setup=write("text.txt", "abcdefgh" * 500)),
    # --- inspect --------------------------------------------------------------------------
    Case("inspect_unknown_key", [*INSPECT, "model.d_modle=32"], ("model.d_modle",)),
    Case("inspect_lr_negative", [*INSPECT, "train.lr=-1"], ("train.lr=-1",)),
    # --- planner --------------------------------------------------------------------------
    Case("plan_nothing_fits", ["plan", "--model", "configs/llama-70b.yaml", "--chips",
                               "h100:1", "--global-batch", "8", "--seq", "4096"],
         ("no plan fits", "1 x h100")),
    Case("plan_write_nothing_fits",
         ["plan", "--model", "configs/llama-70b.yaml", "--chips", "h100:1", "--global-batch",
          "8", "--seq", "4096", "--write", "{tmp}/plan.yaml"],
         ("no plan fits", "nothing was written")),
    Case("plan_bad_chips", [*PLAN[:4], "tpu-v5p", *PLAN[5:]], ("--chips", "tpu-v5p")),
    Case("plan_unknown_chip", [*PLAN[:4], "warp9:8", *PLAN[5:]], ("warp9",)),
    Case("plan_global_batch_zero", [*PLAN[:6], "0", *PLAN[7:]], ("--global-batch", "0")),
    Case("plan_seq_zero", [*PLAN[:8], "0"], ("--seq", "0")),
    Case("plan_seq_not_int", [*PLAN[:8], "long"], ("--seq", "long")),
    Case("plan_non_model_override", [*PLAN, "train.lr=1"], ("train.lr=1",)),
    Case("plan_model_missing", ["plan", "--model", "{tmp}/m.yaml", *PLAN[3:]],
         ("m.yaml", "does not exist")),
    Case("plan_model_bad_key", [*PLAN, "model.d_modle=32"], ("model.d_modle",)),
    Case("plan_catalog_missing", [*PLAN, "--catalog", "{tmp}/chips.yaml"], ("chips.yaml",)),
    Case("plan_write_no_folder", [*PLAN, "--write", "{tmp}/nodir/p.yaml"],
         ("--write", "nodir' does not exist")),
    Case("plan_write_folder", [*PLAN, "--write", "{file}"], ("--write", "is a folder"),
         setup=write("out")),
    Case("plan_write_exists", [*PLAN, "--write", "{file}"],
         ("--write", "exists; pass --force"), setup=write("p.yaml", "keep: me\n")),
    Case("plan_catalog_zero_peak", [*PLAN[:4], "lab:8", *PLAN[5:], "--catalog", "{file}"],
         ("'lab'", "peak_flops=0.0 must be positive"),
         setup=write("chips.yaml", "lab:\n  base: tpu-v5p\n  peak_flops: 0\n")),
    Case("plan_catalog_negative_hbm_bw", [*PLAN, "--catalog", "{file}"],
         ("'lab'", "hbm_bw=-3000000000000.0 must be positive"),
         setup=write("chips.yaml", "lab:\n  base: tpu-v5p\n  hbm_bw: -3.0e12\n")),
    Case("plan_catalog_is_a_folder", [*PLAN, "--catalog", "{file}"], ("is a folder",),
         setup=write("chips")),
    # --- launcher -------------------------------------------------------------------------
    Case("launch_processes_zero", ["launch", "--processes", "0", "--", *CHILD],
         ("--processes",)),
    Case("launch_devices_per_process_zero",
         ["launch", "--processes", "2", "--devices-per-process", "0", "--", *CHILD],
         ("--devices-per-process",)),
    Case("launch_no_command", ["launch", "--processes", "2", "--"], ("command after --",)),
    Case("launch_not_train", [*LAUNCH, "inspect", "--config", "configs/tiny.yaml"],
         ("'inspect'",)),
    Case("out_in_an_unreachable_bucket", [*BASE, "--out", "gs://bucket/run", *SMALL],
         ("--out", "'gs://bucket/run'")),  # no endpoint here (or no such bucket): one line
    Case("data_source_unsupported_scheme", [*TRAIN, "data.source=hdfs://host/train-*.bin"],
         ("data.source", "hdfs:// is not supported")),
    Case("data_sources_weight_zero", [*TRAIN, "data.sources=[{{path: '{file}', weight: 0}}]"],
         ("data.sources[0].weight=0",),
         setup=write("shards/a.bin", np.zeros(64, np.uint16).tobytes())),
    Case("data_source_glob_matches_nothing", [*TRAIN, "data.source={tmp}/none-*.bin"],
         ("none-*.bin", "matches no file")),
    Case("tokenized_uint32_shards_read_as_uint16", [*TRAIN, "data.source={tmp}/made"],
         ("tokenize.json", "uint32 ids", "set data.token_dtype=uint32"), setup=tokenized),
    Case("raw_uint16_shards_read_as_uint32",
         [*TRAIN, "data.source={tmp}/raw", "data.token_dtype=uint32"],
         ("raw/a.bin", "set data.token_dtype=uint16"),
         setup=write("raw/a.bin", (np.arange(4000) % 200 + 2).astype(np.uint16).tobytes())),
    Case("token_dtype_on_text", [*TRAIN, "data.token_dtype=uint32"],
         ("data.token_dtype=uint32", "'stdlib' is text: drop it")),
    Case("launch_child_bad_key", [*LAUNCH, *CHILD, "train.stepz=3"], ("train.stepz",)),
    Case("launch_child_lr_negative", [*LAUNCH, *CHILD, "train.lr=-1"], ("train.lr=-1",)),
    Case("launch_child_out_is_file", [*LAUNCH, *CHILD_BASE, "--out", "{file}",
                                      *SMALL], ("--out", "taken.txt"),
         setup=write("taken.txt", "x")),
    Case("launch_child_batch_per_process", [*LAUNCH, *CHILD, "train.global_batch=3"],
         ("train.global_batch=3",)),
]
BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"

# A few cases run as real processes too; --devices 4 needs a fresh process.
SUBPROCESS = [
    BY_NAME["yaml_error_train"], BY_NAME["devices_zero"], BY_NAME["plan_nothing_fits"],
    BY_NAME["launch_child_bad_key"],
    Case("mesh_needs_more_devices_4", ["train", "--config", "configs/tiny.yaml", "--devices",
                                       "4", "--out", "{out}", "mesh.data=8", *SMALL],
         ("needs 8 devices", "4 are available")),
]


def _params(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)]
                         if c.xfail else []) for c in cases]


def _prepare(case: Case, tmp: Path) -> list[str]:
    subs = {"tmp": str(tmp), "out": str(tmp / "run")}
    if case.setup is not None:
        subs.update(case.setup(tmp))
    return [a.format(**subs) for a in case.argv]


def _snapshot(root: Path) -> dict[str, tuple[bool, int, int]]:
    """Every path under ``root`` (and root) with (is a folder, size, mtime); folders'
    mtimes are left out (a run folder made for a lock and removed again changes nothing)."""
    out = {}
    for p in [root, *root.rglob("*")]:
        st = p.stat()
        out[str(p.relative_to(root))] = ((True, 0, 0) if p.is_dir()
                                         else (False, st.st_size, st.st_mtime_ns))
    return out


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """``jaxpar.cli.main(argv)`` in this process: exit status, stdout, stderr."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def _check(case: Case, code, out: str, err: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, f"exit status {code}; stderr: {err!r}"
    assert "Traceback" not in out and "Traceback" not in err, err
    assert len(lines) == 1, f"stderr is {len(lines)} lines: {err!r}"
    assert lines[0].startswith("jaxpar"), lines[0]
    for culprit in case.culprits:
        assert culprit in lines[0], f"{culprit!r} not in {lines[0]!r}"


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input_in_process(case: Case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    if case.chunk is not None:
        monkeypatch.setattr(jaxpar.data.loader, "SCAN_CHUNK", case.chunk)
    argv = _prepare(case, tmp_path)
    before = _snapshot(tmp_path)
    code, out, err = run_main(argv, capsys)
    _check(case, code, out, err)
    assert _snapshot(tmp_path) == before, "the output folder changed"


@pytest.mark.parametrize("case", _params(SUBPROCESS))
def test_bad_input_subprocess(case: Case, tmp_path):
    argv = _prepare(case, tmp_path)
    before = _snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "jaxpar.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    _check(case, proc.returncode, proc.stdout, proc.stderr)
    assert _snapshot(tmp_path) == before, "the output folder changed"
