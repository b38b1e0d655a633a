"""int8 fixed-point inference for the models of `model/`, plugged in by module surgery.

quantizers  symmetric absmax int8 (per channel, per token, per tensor, clipping search)
dense       QuantDense / QuantEmbed: the int8 twins, with a real s8 x s8 -> s32 dot
modes       the int8 modes by name and QuantError (no JAX: launchers check flags with them)
convert     path rules, the plan, and the swap of Dense/Embed for their twins
calibrate   eager per-layer pass over real batches: input ranges and per-layer int8 error
smoothquant SmoothQuant factors folded into the norms and kernels
auto        per-layer precision choice against an error budget, the per-layer report
pipeline    float params + calibration batches -> quantised model, plan, report
checkpoint  the int8 Orbax layout, loadable sharded onto a mesh
"""
