"""The default model's training (`tools.train_default`): its loss is the cross-entropy of the model's own tokens
alone, and on one conversation repeated a few steps teach a small model of the architecture that conversation,
which greedy decoding and the grading then give back."""

import json
import random

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from paths import TINY_CONFIG

from inkling_jax.chat import DEFAULT_TEMPLATE, ChatTemplate
from inkling_jax.checkpoint.dummy import random_model
from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import load_config
from inkling_jax.sharding import make_mesh
from inkling_jax.tokenizer import Tokenizer
from pallas_kernels.backends import references_only
from tools.default_examples import encode
from tools.default_tasks import tasks
from tools.train_default import grade, loss, padded, train_step

LENGTH = 64
SMALL = {"num_hidden_layers": 2, "layer_types": ["hybrid_sliding", "hybrid"], "n_layers_per_attn_res_block": 2}


@pytest.mark.slow
def test_training_teaches_the_models_turns(tmp_path):
    text = {k: v for k, v in json.loads(TINY_CONFIG.read_text()).items() if k != "dspark_config"} | SMALL
    (tmp_path / "config.json").write_text(json.dumps(text))
    config = load_config(tmp_path / "config.json")
    tokenizer = Tokenizer(build_tokenizer(config.text))
    template = ChatTemplate(DEFAULT_TEMPLATE.read_text())
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    task = next(t for t in tasks(seed, 12, "train") if t.kind == "sum")
    encoded = encode(task, template, tokenizer)
    ids, learned = padded([encoded], LENGTH)
    model = random_model(config, jnp.float32, make_mesh("tp1", config.text), [None, None], seed)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with references_only():
        logits = np.asarray(model(jnp.asarray(ids[:, :-1])), np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        own = np.take_along_axis(log_probs, ids[:, 1:, None], axis=-1)[..., 0][learned[:, 1:]]
        first = float(loss(model, jnp.asarray(ids), jnp.asarray(learned)))
        assert first == pytest.approx(-own.mean(), rel=1e-5)
        for _ in range(60):
            last = float(train_step(model, optimizer, jnp.asarray(ids), jnp.asarray(learned)))
        assert last < 0.05 * first
        assert grade(model, [(task, *encoded)], tokenizer.eos_token_id, LENGTH) == {"all": 1.0, "sum": 1.0}
