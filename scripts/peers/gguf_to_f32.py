#!/usr/bin/env python3
"""A GGUF's weights dequantized to f32, in a new GGUF with the same metadata.

kvbench decodes f32 weights by default on the CPU; llama.cpp reads whatever the GGUF
holds. Given the f32 file, llama.cpp reads the same bytes per decode step as kvbench
(its f32 weights), so both can be set against the same memory-bandwidth bound
(`cpu_generate.py --f32-gguf`).

  python3 scripts/peers/gguf_to_f32.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
      models/SmolLM2-135M-Instruct.f32.gguf

Needs gguf (PyPI, the library llama.cpp ships for Python).
"""

import argparse
import sys

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the GGUF to read (any quantization gguf-py dequantizes)")
    p.add_argument("dst", help="the f32 GGUF to write")
    a = p.parse_args()

    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    r = GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(a.dst, arch)
    for name, field in r.fields.items():
        # The header's own fields are written by the writer; the architecture too.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_file_type(0)  # LLAMA_FTYPE_ALL_F32
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    total = 0
    for t in r.tensors:
        if t.tensor_type == GGMLQuantizationType.F32:
            data = np.array(t.data, dtype=np.float32)
        else:
            data = dequantize(t.data, t.tensor_type).astype(np.float32)
        total += data.nbytes
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{a.dst}: {len(r.tensors)} tensors, {total / 1e6:.1f} MB of f32", file=sys.stderr)


if __name__ == "__main__":
    main()
