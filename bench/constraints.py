"""The host's time per step to compute constrained slots' allowed-token masks, at Inkling 2 Small's vocabulary.

    python -m bench.constraints [--slots 1 64] [--steps 200] [--config configs/inkling2_small.json] [--out FILE]

The synthetic tokenizer of the config (its 200,058 ids: bytes, the built-in corpus's merges, the special tokens,
fillers) stands in for the real one, which cannot be downloaded here; llguidance's mask time grows with the
vocabulary's size and how many tokens a grammar state admits. For each constraint kind (a JSON schema of nested
objects, enums, bounded numbers and a pattern; a regex; a choice; any JSON object) it compiles the constraint in the
chat frame (`runtime.constraints`), then runs `--slots` matchers through it together, as the scheduler does: each
step fills every slot's mask at once (`Grammars.fill`, llguidance's threads) and advances each matcher by a token
drawn at random among those allowed (restarting a matcher that completes). Printed per kind and slot count: the
constraint's compile time (once per kind), and the fill's time per step (median, p90, max) and per slot.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer
from inkling_jax.config import load_config
from inkling_jax.runtime.constraints import Constraint, Grammars
from inkling_jax.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,40}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "scores", "address"],
}
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "regex": Constraint("regex", r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{1,4}"),
    "choice": Constraint("choice", ("positive", "negative", "neutral", "mixed feelings")),
    "json_object": Constraint("json_object"),
}


def run(grammars: Grammars, constraint: Constraint, frame: str, slots: int, steps: int, rng) -> dict:
    """Fill times of `steps` steps of `slots` matchers walking `constraint` (compiled) at random."""
    matchers = {slot: grammars.matcher(constraint, frame) for slot in range(slots)}
    allowed = np.zeros((slots, grammars.words), np.int32)
    ids = np.arange(grammars.words * 32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        grammars.fill(allowed, matchers)
        times.append(time.perf_counter() - start)
        for slot, matcher in matchers.items():
            choices = ids[((allowed[slot][ids // 32] >> (ids % 32)) & 1).astype(bool)]
            if matcher.complete:
                matchers[slot] = grammars.matcher(constraint, frame)
            else:
                matcher.accept([int(rng.choice(choices))])
    ms = np.asarray(times) * 1e3
    return {
        "fill_ms_median": round(float(np.median(ms)), 3),
        "fill_ms_p90": round(float(np.percentile(ms, 90)), 3),
        "fill_ms_max": round(float(ms.max()), 3),
        "fill_us_per_slot_median": round(float(np.median(ms)) * 1e3 / slots, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", type=Path, default=Path(__file__).resolve().parents[1] / "configs" / "inkling2_small.json"
    )
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    text = load_config(args.config).text
    start = time.perf_counter()
    tokenizer = Tokenizer(build_tokenizer(text))
    eos = text.eos_token_id if isinstance(text.eos_token_id, tuple) else (text.eos_token_id,)
    grammars = Grammars(tokenizer, text.unpadded_vocab_size, eos)
    print(
        f"tokenizer of {text.unpadded_vocab_size} ids and its grammar tables: {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    rows = []
    for kind, constraint in CONSTRAINTS.items():
        start = time.perf_counter()
        grammars.compile(constraint, "text")
        compiled = {"compile_ms": round((time.perf_counter() - start) * 1e3, 3)}
        for slots in args.slots:
            times = run(grammars, constraint, "text", slots, args.steps, np.random.default_rng(0))
            row = {"kind": kind, "slots": slots, **compiled, **times}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        command = "python -m bench.constraints " + " ".join(sys.argv[1:] if argv is None else argv)
        args.out.write_text(
            json.dumps({"command": command, "vocabulary": text.unpadded_vocab_size, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
