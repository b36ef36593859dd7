"""One of the processes of tests/cli/test_hf_commands.py's multi-process test: joins the run
(``JAXPAR_*`` environment), loads a Hugging Face folder sharded over all processes'
devices, writes what it read and the logits to ``result-<process>.json`` beside the
output folder (a file, not stdout: a long line there can be cut by other processes'
logging), and saves the model back collectively."""

import json
import sys
from pathlib import Path

from jaxpar.runs.distributed import initialize

initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import hf  # noqa: E402

folder, out, ids_json = sys.argv[1], sys.argv[2], sys.argv[3]
ids = np.array(json.loads(ids_json), dtype=np.int32)
plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"fsdp": 4, "tensor": 2}), "fsdp_tp")
stats: dict = {}
model = hf.load(folder, plan=plan, stats=stats)
tokens = jax.make_array_from_callback(ids.shape, plan.replicated, lambda index: ids[index])
with plan.activate():
    logits = jax.jit(lambda m, x: m(x))(model, tokens)
full = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
hf.save(model, out)
result = {"process": jax.process_index(), "bytes_read": stats["bytes_read"],
          "logits": full.tolist()}
(Path(out).parent / f"result-{jax.process_index()}.json").write_text(json.dumps(result))
