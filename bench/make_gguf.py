"""A full-size Wan transformer as a GGUF file of seeded random weights, laid out as city96's Wan GGUFs
quantize (fixtures README, "GGUF, the way city96 makes Wan GGUFs"): the blocks' attention and feed-forward
weights in the chosen block type, F32 for 1-D tensors, small tensors and the 5-D patch embedding, F16 for
the other 2-D weights. Keys in diffusers' names (vidgen tells the layout from the keys).

    python3 bench/make_gguf.py TABLE.json MODEL_KEY OUT.gguf [Q8_0|Q4_0|BF16]

(BF16: the same tensors unquantized, a bf16 single file to run `--storage-dtype` against.)

TABLE.json: tests/fixtures/wan2.1-configs.json (its state_dicts[MODEL_KEY].tensors: name -> shape).
Needs numpy and gguf-py (python3 -m pip download --no-deps gguf).

The values are runs of blocks of one seeded pool, quantized once (rather than a fresh draw quantized per
tensor), so that a 14B file is written in about a minute: speed and memory depend on the shapes, not on the
values."""
import json
import re
import sys

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
QUANTIZED = re.compile(r"^blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)\.weight$|^blocks\.\d+\.ffn\.net\.(0\.proj|2)\.weight$")


POOL = 1 << 24


def pooled(pool, t, cache={}):
    """The seeded pool stored as block type `t`: an array of blocks (one row per block; typed
    values for F16/F32), quantized once."""
    if t not in cache:
        if t in (QT.F16, QT.F32):
            cache[t] = gguf.quants.quantize(pool, t).reshape(-1, 1)
        else:
            cache[t] = gguf.quants.quantize(pool.reshape(-1, 256), t).reshape(-1, gguf.GGML_QUANT_SIZES[t][1])
    return cache[t]


def main(table_path, key, out, kind="Q8_0"):
    tensors = json.load(open(table_path))["state_dicts"][key]["tensors"]
    qt = QT[kind]
    pool = (np.random.default_rng(0).standard_normal(POOL, dtype=np.float32) * 0.02).astype(np.float32)
    at = 0
    w = gguf.GGUFWriter(path=None, arch="wan")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + kind))
    stored = 0
    for name in sorted(tensors):
        shape = tuple(tensors[name])
        n = int(np.prod(shape))
        if QUANTIZED.match(name) and shape[-1] % gguf.GGML_QUANT_SIZES[qt][0] == 0:
            t = qt
        elif len(shape) == 2 and n > 1024:
            t = QT.F16
        else:
            t = QT.F32
        if name.endswith("norm.weight") or ".norm" in name and name.endswith(".weight"):
            blob = gguf.quants.quantize(np.ones(shape, np.float32), t)
        else:
            # Consecutive blocks of the pool from a moving start: the same as quantizing the
            # pool's values at that place, without quantizing 14 billion values.
            blocks = pooled(pool, t)
            per_block = gguf.GGML_QUANT_SIZES[t][0] if t not in (QT.F16, QT.F32) else 1
            idx = (at + np.arange(n // per_block)) % len(blocks)
            at = (at + 7919) % len(blocks)
            blob = blocks[idx]
            blob = blob.reshape(shape) if per_block == 1 else blob.reshape(*shape[:-1], -1)
        stored += blob.nbytes
        w.add_tensor(name, blob, raw_dtype=t)
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(json.dumps({"file": out, "tensor_bytes": stored, "tensors": len(tensors), "kind": kind}))


if __name__ == "__main__":
    main(*sys.argv[1:])
