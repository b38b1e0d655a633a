"""How close each int8 mode keeps MiniLM's sentence embeddings to float's (the library of
`experiments.embed_fidelity`): cosine to the float embedding, top-1/top-10 retrieval agreement,
parameter bytes, speed of float and w8a8, and the float model's activation outliers.
"""

from __future__ import annotations

import json
import platform

import numpy as np

from experiments.pretrained.minilm import (
    encode,
    load_encoder,
    make_encode_fn,
    outlier_table,
    quantize_encoder,
    retrieval,
    throughput,
)
from quant.encoder import calibration_rows
from quant.pipeline import param_bytes


def fidelity(modes: list[str], texts: list[str], calib: list[str]) -> dict:
    """Each of `modes` on `texts` against the float model, calibrated on `calib` (texts apart
    from the measured ones); a row per mode is printed as it is measured."""
    graphdef, params, tok = load_encoder()
    float_fn = make_encode_fn(graphdef)
    ref = encode(float_fn, params, tok, texts)
    results, speed = [], {"float": throughput(float_fn, params, tok, texts)}
    for mode in modes:
        qdef, qparams, _ = quantize_encoder(graphdef, params, tok, mode, calib)
        qfn = make_encode_fn(qdef)
        emb = encode(qfn, qparams, tok, texts)
        cos = np.sum(emb * ref, axis=1)  # both unit-norm
        top1, top10 = retrieval(ref, emb)
        results.append({"mode": mode, "mean_cosine": float(cos.mean()),
                        "min_cosine": float(cos.min()), "top1_agreement": top1,
                        "top10_overlap": top10, "param_bytes": param_bytes(qparams)})
        if mode == "w8a8":
            speed["w8a8"] = throughput(qfn, qparams, tok, texts)
        print(json.dumps(results[-1]), flush=True)
    out = {"results": results, "float_param_bytes": param_bytes(params),
           "sentences_per_s": speed, "n_sentences": len(texts), "n_calib": len(calib),
           "python": platform.python_version(),
           "outliers": outlier_table(graphdef, params,
                                     calibration_rows(tok.encode(calib)[0], 32)[:2])}
    return out
