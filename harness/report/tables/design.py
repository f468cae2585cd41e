"""Gate B: the design measurements (slot writes, kernels, parity), beside the paper's own figures."""

from .common import MACHINE, latest, machine_cols

# The paper's own figures, quoted from shared/seeds/004_f9dda6381342b645.txt (implementation
# section): for comparison beside what this harness measures, never used as a result.
PAPER = {
    ("slot_write", "inplace", 64): 0.305,
    ("kernel", "loop_quantized_matmul", None): 0.43,
    ("kernel", "gather_qmm", None): 0.26,
    ("kernel", "restack_gather_qmm", None): 0.50,
    ("parity", "unfused", None): 0.0195,
    ("parity", "compiled_swiglu", None): 0.0,
}


def design_table(recs):
    rows = []
    for r in recs:
        res = r["result"]
        variant = res.get("install") or res.get("variant")
        slots = res.get("slots")
        paper = PAPER.get((res["measure"], variant, slots if res["measure"] == "slot_write" else None))
        parity = res["measure"] == "parity"
        value = res["max_abs_logit_diff"] if parity else res["ms"]
        rows.append(
            dict(
                **machine_cols(r),
                measure=res["measure"],
                variant=variant,
                slots=slots,
                model=res.get("model"),
                dtype=r["config"].get("dtype") if res["measure"] != "parity" else res.get("dtype"),
                value=value,
                value_min=None if parity else res.get("ms_min"),
                value_max=None if parity else res.get("ms_max"),
                unit="max|dlogit|" if parity else "ms",
                paper=paper,
                started_utc=r["started_utc"],
                run_id=r["run_id"],
            )
        )
    return latest(rows, MACHINE + ["measure", "variant", "slots", "model"])
