#!/usr/bin/env python3
"""Converts a tiktoken rank file (`<base64 token> <rank>` per line, e.g. o200k_base.tiktoken
from openai/tiktoken, MIT) into the estimator's compact vocabulary: every token in rank order,
each as a one-byte length followed by its bytes. Ranks must run 0..n without gaps.
    python3 scripts/tiktoken-to-tokens.py o200k_base.tiktoken[.gz] src/estimate/data/o200k_base.tokens
"""
import base64, gzip, sys

src, dst = sys.argv[1], sys.argv[2]
opener = gzip.open if src.endswith(".gz") else open
tokens = {}
with opener(src, "rb") as f:
    for line in f:
        if not line.strip():
            continue
        tok, rank = line.split()
        tokens[int(rank)] = base64.b64decode(tok)
assert sorted(tokens) == list(range(len(tokens))), "ranks must be 0..n"
with open(dst, "wb") as out:
    for r in range(len(tokens)):
        t = tokens[r]
        assert 0 < len(t) < 256, (r, len(t))
        out.write(bytes([len(t)]) + t)
print(f"{len(tokens)} tokens, longest {max(map(len, tokens.values()))} bytes")
