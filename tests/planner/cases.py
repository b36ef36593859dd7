"""Tables and builders shared by several planner test files (not collected by pytest).

``MODELS`` and :func:`make_config` build the small run configs the planner is checked
against XLA with; ``TINY`` is a small transformer whose parameter count is worked out by
hand below, for tests that compare the planner with arithmetic of their own."""

import jaxpar
from jaxpar.models import TransformerConfig

MODELS = {
    "A": "vocab_size=256 d_model=64 n_layers=2 n_heads=8 n_kv_heads=4 d_ff=128",
    "B": "vocab_size=512 d_model=128 n_layers=2 n_heads=8 n_kv_heads=8 d_ff=512",
    "C": "vocab_size=1024 d_model=256 n_layers=2 n_heads=8 n_kv_heads=8 d_ff=1024",
    "V": "vocab_size=16384 d_model=64 n_layers=2 n_heads=8 n_kv_heads=4 d_ff=128",
}
MIXTRAL = "configs/mixtral-8x7b.yaml"


def make_config(model: str, batch: int, seq: int, knobs: str) -> jaxpar.Config:
    """A run config of ``model`` (a key of :data:`MODELS` or ``field=value`` pairs) at
    global batch ``batch`` and sequence ``seq``, with ``knobs`` (overrides) applied."""
    return jaxpar.load_config(None, [
        *(f"model.{kv}" for kv in MODELS.get(model, model).split()), *knobs.split(),
        f"train.global_batch={batch}", f"train.seq_len={seq}", f"model.max_seq_len={seq}",
        "train.steps=5", "train.warmup_steps=1"])


TINY = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=256)
"""head_dim 16; every sharded dimension divides by 8."""
TINY_LAYER_PARAMS = (2 * 64  # the two norm scales
                     + 64 * 16 * (4 + 2 + 2)  # wq, wk, wv
                     + 4 * 16 * 64  # wo
                     + 3 * 64 * 256)  # gate, up, down
TINY_PARAMS = 256 * 64 + 2 * TINY_LAYER_PARAMS + 64 + 64 * 256  # embed, layers, norm, head
TINY_MATMUL_PARAMS = TINY_PARAMS - 256 * 64 - 2 * 2 * 64 - 64  # less the table and norms
