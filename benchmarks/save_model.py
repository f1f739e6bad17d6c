#!/usr/bin/env python3
"""Save bench_generate's M3-shaped random model and its dense twin as checkpoints a server can
load: the weights and config, and the toy byte-level BPE tokenizer with its chat template
(``m3_hf_attention.toy_tokenizer``), sized to the model's vocabulary. The server's
``--attn-implementation`` picks the attention (m3-serve's default: m3_sparse).

    python3 benchmarks/save_model.py --layers sfs --out /data/m3     # m3-sfs/ and dense-sfs/
    m3-serve /data/m3/m3-sfs --continuous-batching                  # m3_sparse
    m3-serve /data/m3/dense-sfs --continuous-batching --attn-implementation sdpa   # the twin

The weights are bench_generate's for the same ``--seed``, shapes and ``--layers`` (the twin:
every layer full attention, same weights without the indexers), in bf16 unless ``--dtype``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate  # noqa: E402  (its model builder; registers m3_sparse)

from m3_hf_attention.toy_tokenizer import save_tokenizer  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory that gets m3-LAYERS/ and dense-LAYERS/")
    p.add_argument("--layers", default="sfs", help="pattern of s (sparse) and f (full attention) layers")
    p.add_argument("--max-len", type=int, default=131072, help="the models' max_position_embeddings floor (tokens)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="bench_generate's toy attention shapes")
    p.add_argument("--no-eos", action="store_true",
                   help="no end-of-sequence token in the configs (-1): every request generates all its max_tokens")
    args = p.parse_args(argv)
    (pattern,) = bench_generate.parse_layers(args.layers)
    # What bench_generate.build_models reads from its own arguments.
    args.device = "cpu"
    args.sizes = [bench_generate.Shape(1, args.max_len // 2)]
    models = bench_generate.build_models(args, pattern, getattr(torch, args.dtype))
    for name, key in (("m3", "sparse"), ("dense", "dense")):
        model = models[key]
        if args.no_eos:
            model.config.eos_token_id = model.generation_config.eos_token_id = -1
        target = args.out / f"{name}-{pattern}"
        model.save_pretrained(target)
        save_tokenizer(target, model.config.vocab_size)
        print(f"{target}: layers {''.join('s' if t == bench_generate.SPARSE else 'f' for t in model.config.layer_types)}, "
              f"vocab {model.config.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
