"""Trained-bias nn.MultiheadAttention(8, 8) weights (torch_layer(8, 8, seed=s, float64=True,
trained_biases=True), readout unit_readout(8, 0)) as a float64 BiasedMultiHeadAttention
box (the layer's own function: W_h = K_h^T Q_h, b_h = K_h^T b_q,h (/ sqrt(hd)),
v_h = V_h^T O_h^T r, c), learner seed 0, told H = 8 and not.

Run:  python benchmarks/biasbasin_torch_weights.py SEEDS D H ["told"|"not told"|"told,not told"]
(SEEDS comma-separated); one JSON line per run on stdout."""
import sys, time, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import attnextract
from attnextract.oracle import Oracle
from attnextract.models import BiasedMultiHeadAttention
import user_boxes as ub
d, H = int(sys.argv[2]), int(sys.argv[3])
seeds = [int(s) for s in sys.argv[1].split(",")]
modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["told", "not told"]
for mode in modes:
    told = mode == "told"
    for s in seeds:
        layer = ub.torch_layer(d, H, seed=s, float64=True, trained_biases=True)
        r = ub.unit_readout(d, 0)
        W, v, b, c = ub.torch_truth(layer, r)
        box = BiasedMultiHeadAttention(W, v, b, c)
        t = time.time()
        row = {"seed": s, "heads told": told}
        try:
            oracle = Oracle(box, dim=d)
            res = attnextract.extract(oracle, model="multi-head", heads=H if told else None, biases=True, seed=0)
            e = ub.canonical_errors(res.model, W, v, b, c)
            row.update(outcome="recovered", error=max(e["W"], e["v"], e["c"]), heads=e["heads"], queries=oracle.queries,
                       bar=res.report.details.get("error bar"), designs=res.report.details.get("designs tried", 1))
        except attnextract.errors.AttnExtractError as ex:
            row.update(outcome="refused", error_type=type(ex).__name__, message=str(ex)[:200])
            res = ex
        details = res.report.details if hasattr(res, "report") else (res.result.report.details if getattr(res, "result", None) else {})
        mv = details.get("column moves / gap (median, max)")
        row["moves/gap max"] = float(mv[1]) if mv else None
        row["base estimate error"] = details.get("base estimate relative error")
        row["seconds"] = round(time.time() - t, 1)
        print(json.dumps(row), flush=True)
