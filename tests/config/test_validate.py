"""A run config checked whole: every range, the choices, the fields that constrain each
other, and (given the device count) the mesh and batch split; each failure is one
JaxparError naming the key and its value. The CLI table in ``tests/cli/test_bad_input.py``
runs many more mistakes end to end; these call :func:`check_config` directly."""

import json
import re

import pytest

from jaxpar import JaxparError, load_config
from jaxpar.config.validate import check_config
from jaxpar.errors import JaxparWarning

MODEL = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.d_ff=64",
         "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
         "train.seq_len=16", "train.global_batch=8"]


def config(*overrides: str):
    return load_config(None, [*MODEL, *overrides])


def test_a_sensible_config_passes():
    check_config(config())
    check_config(config(), devices=8)
    check_config(config("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), devices=8)
    check_config(config("mesh.data=2", "mesh.fsdp=-1"), devices=8)
    check_config(config("mesh.data=1", "mesh.stage=2", "mesh.fsdp=-1", "train.global_batch=16",
                        "pipeline.microbatches=4"), devices=8)


@pytest.mark.parametrize("override, message", [
    ("pipeline.microbatches=-1", "pipeline.microbatches=-1: must be 0 (one per stage) or more"),
    ("pipeline.repeats=-2", "pipeline.repeats=-2: must be 0 (as many as the layers allow)"),
    ("train.warmup_steps=-1", "train.warmup_steps=-1: must be 0 or more"),
    ("train.weight_decay=-0.1", "train.weight_decay=-0.1: must be 0 or a positive number"),
    ("train.weight_decay=.inf", "train.weight_decay=inf: must be 0 or a positive number"),
    ("train.lr=.inf", "train.lr=inf: must be a positive number"),
    ("train.lr=0", "train.lr=0.0: must be a positive number"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0: must be 0 (no clipping) or a positive"),
    ("train.seed=-1", "train.seed=-1: must be 0 or more"),
    ("train.eval_every=-1", "train.eval_every=-1: must be 0 (no evaluation) or more"),
    ("train.eval_batches=0", "train.eval_batches=0: must be at least 1"),
    ("data.max_bytes=0", "data.max_bytes=0: must be at least 1"),
    ("data.holdout_fraction=1", "data.holdout_fraction=1.0: must be a fraction in [0, 1)"),
    ("data.holdout_fraction=-0.1", "data.holdout_fraction=-0.1: must be a fraction"),
    ("checkpoint.every=-1", "checkpoint.every=-1: must be 0 (only at the end) or more"),
    ("lora.alpha=0", "lora.alpha=0.0: must be a positive number"),
    ("mesh.tensor=-2", "mesh.tensor=-2: must be at least 1, or -1 (filled from the device"),
    ("mesh.dcn_data=-1", "mesh.dcn_* sizes must be given (at least 1), not -1"),
])
def test_ranges(override, message):
    with pytest.raises(JaxparError) as err:
        check_config(config(*override) if isinstance(override, tuple) else config(override))
    assert str(err.value).startswith(message), str(err.value)


def test_at_most_one_mesh_axis_is_free():
    with pytest.raises(JaxparError, match=r"mesh axes mesh.data, mesh.tensor are all -1: at "
                                          r"most one axis"):
        check_config(config("mesh.data=-1", "mesh.tensor=-1"))


@pytest.mark.parametrize("override, message", [
    ("plan.rules=zigzag", "plan.rules='zigzag': choose one of ["),
    ("plan.annotations=[['a(', ['embed']]]", "plan.annotations='a(': is not a valid regular"),
    ("plan.layouts=[['w(', 'x']]", "plan.layouts='w(': is not a valid regular expression"),
    ("train.optimizer=adamz", "train.optimizer='adamz': choose one of ['adamw', 'adam',"),
    ("pipeline.split=pkg.mod:SPLIT",
     "pipeline.split='pkg.mod:SPLIT': divides a model.factory model into stages"),
    ("train.trainable=(x", "train.trainable='(x': is not a valid regular expression"),
    ("train.loss=justaname", "train.loss='justaname': must look like package.module:function"),
    ("model.factory=no way:x", "model.factory='no way:x': must look like package.module"),
    ("train.profile_steps=[0, 2]", "train.profile_steps=[0, 2] is invalid"),
    (("plan.quantize=fp8", "plan.precision=p=f32,c=f16,o=f32"),
     "plan.quantize=fp8 with float16 compute (plan.precision) is not supported"),
    ("data.eos_id=-2", "data.eos_id=-2: must be -1 (no document masks) or an id below"),
])
def test_choices(override, message):
    with pytest.raises(JaxparError) as err:
        check_config(config(*override) if isinstance(override, tuple) else config(override))
    assert str(err.value).startswith(message), str(err.value)


def test_what_choices_allow():
    # "type:" annotation patterns name classes, not regexes; keywords of train.trainable
    # and dotted or colon specs are fine.
    check_config(config("plan.annotations=[['type:Foo(', ['embed']]]"))
    for ok in ("train.trainable=lora", "train.trainable=all", "train.trainable=attn|mlp",
               "train.loss=pkg.mod:fn", "train.loss=pkg.mod.fn", "model.factory=a:b.c"):
        check_config(config(ok))


def test_tokenizer_settings(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("some text\n")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")  # only its presence is checked here
    check_config(config(f"data.source={text}", f"data.tokenizer={tok}"))
    check_config(config(f"data.source={text}", f"data.tokenizer={tok / 'tokenizer.json'}"))
    cases = [
        ([f"data.tokenizer={tok}"], "data.source='stdlib': with data.tokenizer set, must be"),
        ([f"data.source={tmp_path}", f"data.tokenizer={tmp_path / 'none.json'}"],
         f"data.tokenizer='{tmp_path / 'none.json'}': is neither a tokenizer.json file"),
        ([f"data.source={tmp_path}", f"data.tokenizer={tmp_path}"],
         f"data.tokenizer='{tmp_path}': is neither"),  # a folder without tokenizer.json
        ([f"data.source={text}", f"data.tokenizer={tok}", "data.field="],
         "data.field='': must name the key of each .jsonl record's text"),
    ]
    ids = tmp_path / "ids.npy"
    ids.write_bytes(b"")
    cases.append(([f"data.source={ids}", f"data.tokenizer={tok}"],
                  f"data.source='{ids}': with data.tokenizer set"))
    for overrides, message in cases:
        with pytest.raises(JaxparError) as err:
            check_config(config(*overrides))
        assert str(err.value).startswith(message), (overrides, str(err.value))


def test_init_from(tmp_path):
    check_config(config(f"init_from={tmp_path}"))  # an existing folder
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    check_config(config(f"init_from=hf:{tmp_path}"))
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"")
    with pytest.raises(JaxparError, match=r"init_from='.*weights.bin': is not a folder"):
        check_config(config(f"init_from={afile}"))
    with pytest.raises(JaxparError, match=r"init_from='hf:.*nowhere': is not a Hugging Face "
                                          r"model folder \(no config.json\)"):
        check_config(config(f"init_from=hf:{tmp_path / 'nowhere'}"))


def test_expert_knobs_on_a_dense_model():
    for knob, value in (("expert_d_ff", "16"), ("router_z_loss", "0.5"),
                        ("n_shared_experts", "1")):
        with pytest.raises(JaxparError, match=rf"model.{knob}={value} configures experts, but "
                                              r"model.n_experts=0"):
            check_config(config(f"model.{knob}={value}"))
    check_config(config("model.n_experts=4", "model.expert_d_ff=16"))
    # A model.factory model has no such knobs to misuse: nothing is checked.
    check_config(config("model.factory=pkg.mod:fn", "model.expert_d_ff=16"))


def test_layout_checks_need_the_device_count():
    cfg = config("train.global_batch=30")
    check_config(cfg)  # nothing to divide by yet
    with pytest.raises(JaxparError, match=r"train.global_batch=30 is not divisible by the "
                                          r"data-parallel size 8 \(data=8 under "
                                          r"plan.rules=fsdp_tp\): use a multiple of 8"):
        check_config(cfg, devices=8)


@pytest.mark.parametrize("overrides, kwargs, message", [
    ([], dict(devices=0), "0 devices: a run needs at least one"),
    (["train.global_batch=6", "mesh.data=1", "mesh.fsdp=1"], dict(devices=1, processes=4),
     "train.global_batch=6 is not divisible by the 4 processes of this run"),
    (["train.global_batch=16", "plan.microbatches=4"], dict(devices=8),
     "train.global_batch=16 (each of plan.microbatches=4 holds 4) is not divisible by the "
     "data-parallel size 8 (data=8 under plan.rules=fsdp_tp): use a multiple of 32"),
    (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.global_batch=6"], dict(devices=8),
     "train.global_batch=6 is not divisible by the data-parallel size 4 (data=2 x fsdp=2 "
     "under plan.rules=fsdp_tp): use a multiple of 4"),
    (["mesh.data=1", "mesh.stage=2", "mesh.fsdp=-1", "pipeline.microbatches=4"],
     dict(devices=8), "train.global_batch=8 does not split into 4 pipeline microbatches "
     "(pipeline.microbatches) of equal size on each of the 4 data-parallel devices: use a "
     "multiple of 16"),
    (["mesh.stage=2", "mesh.data=-1", "model.factory=pkg.mod:fn"], dict(devices=8),
     "mesh.stage > 1 with a model.factory model needs pipeline.split"),
    (["mesh.stage=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.schedule=1f1b",
      "diloco.sync_every=2"],
     dict(devices=8), "pipeline.schedule=1f1b runs the backward pass inside its own "
     "shard_map, which diloco.sync_every cannot enter"),
    (["mesh.stage=2", "mesh.data=4", "pipeline.schedule=interleaved_1f1b",
      "plan.compress_gradients=sign", "plan.zero_stage=0"], dict(devices=8),
     "pipeline.schedule=interleaved_1f1b runs the backward pass inside its own shard_map, "
     "which plan.compress_gradients=sign cannot enter"),
    (["mesh.context=2", "mesh.stage=2", "mesh.data=2"], dict(devices=8),
     "mesh.context > 1 with mesh.stage > 1 is not supported yet"),
    (["mesh.stage=2", "mesh.data=4", "model.n_experts=4"], dict(devices=8),
     "model.n_experts > 0 with mesh.stage > 1 is not supported yet"),
    (["mesh.context=2", "mesh.data=4", "train.seq_len=18"], dict(devices=8),
     "train.seq_len=18 does not split into 4 equal chunks over mesh.context=2 "
     "(plan.context_balance lays it out in 2 x context chunks): use a multiple of 4"),
    (["mesh.context=4", "mesh.data=2", "train.seq_len=18", "plan.context_balance=false"],
     dict(devices=8), "train.seq_len=18 does not split into 4 equal chunks over "
     "mesh.context=4: use a multiple of 4"),
    (["mesh.expert=4", "mesh.data=2", "model.n_experts=4", "model.expert_capacity=0"],
     dict(devices=8), "model.expert_capacity=0 (dropless experts) with mesh.expert=4"),
    (["plan.strict=true", "model.n_heads=6", "model.n_kv_heads=2", "model.d_model=48",
      "mesh.tensor=4", "mesh.data=2"], dict(devices=8),
     "plan.strict=true: dimension 0 ('heads', size 6) of model.n_heads is not divisible"),
    (["mesh.data=3"], dict(devices=8), "mesh data=3 needs 3 devices, but 8 are available"),
])
def test_layout(overrides, kwargs, message):
    cfg = config(*overrides)
    check_config(cfg)  # each is a problem of the layout only
    with pytest.raises(JaxparError) as err:
        check_config(cfg, **kwargs)
    assert str(err.value).startswith(message), str(err.value)


def test_balanced_context_chunks_that_divide_pass():
    check_config(config("mesh.context=2", "mesh.data=4", "train.seq_len=20"), devices=8)
    check_config(config("mesh.context=2", "mesh.data=4", "train.seq_len=18",
                        "plan.context_balance=false"), devices=8)


@pytest.mark.parametrize("overrides, warning", [
    (["plan.quantize_target=blocks/mlp/.*"], "plan.quantize_target picks the matmuls"),
    (["pipeline.schedule=1f1b", "pipeline.microbatches=4"],
     "pipeline.schedule, pipeline.microbatches configure pipeline stages, but mesh.stage is 1"),
    (["diloco.sync_every=50", "train.steps=2", "mesh.data=2"],
     "diloco.sync_every=50 is more than train.steps=2: the replicas never meet"),
    (["plan.remat=full", "plan.remat_blocks=blocks"], "plan.remat_blocks='blocks' picks a "
     "model.factory model's blocks; jaxpar's own model applies plan.remat to each"),
])
def test_knobs_that_would_do_nothing_are_named_at_start(overrides, warning):
    with pytest.warns(JaxparWarning, match=re.escape(warning)):
        check_config(config(*overrides))


def test_a_knob_that_does_nothing_is_named_once_however_often_it_is_checked():
    """jaxpar train checks its config three times (arguments, devices, trainer): the
    line shows once, under Python's default warning filter."""
    import warnings

    cfg = config("pipeline.schedule=gpipe", "plan.remat_blocks=^blocks/1$")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("default")
        check_config(cfg)  # three calls from three places, as jaxpar train's
        check_config(cfg, devices=8)
        check_config(cfg)
    assert [str(w.message) for w in said] == [
        "plan.remat_blocks='^blocks/1$' picks the blocks plan.remat recomputes, but "
        "plan.remat is none: it does nothing (set plan.remat, e.g. plan.remat=full)",
        "pipeline.schedule configure pipeline stages, but mesh.stage is 1: they do nothing"]
