"""A full-size Wan transformer as a GGUF file of seeded random weights, laid out as city96's Wan GGUFs
quantize (fixtures README, "GGUF, the way city96 makes Wan GGUFs"): the blocks' attention and feed-forward
weights in the chosen block type, F32 for 1-D tensors, small tensors and the 5-D patch embedding, F16 for
the other 2-D weights. Keys in diffusers' names (vidgen tells the layout from the keys).

    python3 bench/make_gguf.py TABLE.json MODEL_KEY OUT.gguf [Q8_0|Q4_0|BF16]

(BF16: the same tensors unquantized, a bf16 single file to run `--storage-dtype` against.)

TABLE.json: tests/fixtures/wan2.1-configs.json (its state_dicts[MODEL_KEY].tensors: name -> shape).
Needs numpy and gguf-py (python3 -m pip download --no-deps gguf)."""
import json
import re
import sys

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
QUANTIZED = re.compile(r"^blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)\.weight$|^blocks\.\d+\.ffn\.net\.(0\.proj|2)\.weight$")


def main(table_path, key, out, kind="Q8_0"):
    tensors = json.load(open(table_path))["state_dicts"][key]["tensors"]
    qt = QT[kind]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path=None, arch="wan")
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + kind))
    stored = 0
    for name in sorted(tensors):
        shape = tuple(tensors[name])
        data = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        if name.endswith("norm.weight") or ".norm" in name and name.endswith(".weight"):
            data = np.ones(shape, np.float32)
        if QUANTIZED.match(name) and shape[-1] % gguf.GGML_QUANT_SIZES[qt][0] == 0:
            t = qt
        elif len(shape) == 2 and data.size > 1024:
            t = QT.F16
        else:
            t = QT.F32
        blob = gguf.quants.quantize(data, t)
        stored += blob.nbytes
        w.add_tensor(name, blob, raw_dtype=t)
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(json.dumps({"file": out, "tensor_bytes": stored, "tensors": len(tensors), "kind": kind}))


if __name__ == "__main__":
    main(*sys.argv[1:])
