"""The tests' numerical bounds, each derived from the arithmetic.

Every comparison with a reference (unsharded optax, plain data parallel,
another N) is between two programs that do the same math in a different
order, or with a different number of roundings. The bound is what that
difference can reach, with headroom for code generation this machine does
not produce (another CPU's vector width, FMA contraction, fusion: XLA:CPU
rounds differently by machine). ``experiments/testing/tolerance_sweep.py`` runs the
numerical tests under ``--xla_cpu_max_isa=AVX2`` / ``AVX`` and
``--xla_cpu_enable_fast_math=true`` and ``docs/tolerances.md`` records the
worst error each bound saw there (the recorded run: every bound holds
under each; fast-math changes the arithmetic, and two 1e-6 bounds keep
little room there).

``assert_close`` compares per leaf: max |got - want| <= rtol * max|want|.
Near-zero elements are judged against the leaf's largest one, so a
relative blow-up where a gradient nearly cancels does not count, while a
lost or doubled update anywhere in the leaf does.
"""

U32 = 2.0 ** -24    # fp32 unit roundoff (half an ulp at 1)
U16 = 2.0 ** -11    # fp16
UBF16 = 2.0 ** -8   # bf16
FP16_SUBNORMAL_STEP = 2.0 ** -24   # spacing of fp16's subnormals


def momentum_gain(momentum: float, steps: int) -> float:
  """How much one step's gradient error can move a weight, summed over all
  steps, in units of lr: SGD with (heavy-ball) momentum applies a gradient
  error made at step j at every later step t with weight momentum^(t-j), so
  the errors of ``steps`` steps add up to at most
  sum_j sum_{t>=j} momentum^(t-j) gradient errors."""
  return sum(sum(momentum ** (t - j) for t in range(j, steps))
             for j in range(steps))


# fp32, same math in another summation order (the common case: zero1 at N
# devices vs one device's optax, vs DDP, vs another N, vs a restored run),
# weights compared per leaf against the leaf's largest weight.
#
# Each gradient element of the tests' tiny models is a sum of R = 16
# per-row terms (helpers.batch(16)) of size ~G (G ~ 1 here). Another order
# of that sum (per-device partial sums and the all-reduce / reduce-scatter
# tree; FMA contraction on one CPU and not another) changes it by a sum of
# R - 1 roundings, each uniform within +-U32/2 of a partial sum: standard
# deviation ~ U32 * sqrt(R / 3) * G = 1.4e-7 G. (The worst case, every
# rounding the same way, is (R - 1) * U32 * G = 9e-7 G: not reached by
# independent roundings, and never measured.)
# - SGD (lr, momentum b, T steps) moves a weight by lr * g_j for the error
#   g_j of step j, g_j <= sum_t b^(t-j) <= 1 / (1 - b): independent errors
#   add as a random walk, sigma = lr * sqrt(sum_j g_j^2) * 1.4e-7. The
#   widest family, sgd(1e-2, momentum=0.9, nesterov) over 20 steps
#   (test_equivalence: Nesterov adds a b * m term, g_j <= (1 + b) / (1 - b)
#   = 19): 1e-2 * sqrt(20) * 19 * 1.4e-7 = 1.2e-7; 6 sigma = 7.1e-7.
# - Adam's m / sqrt(v) is scale-free in g, so a relative gradient error
#   stays a relative update error of ~lr per step: 20 steps of 1e-2 x
#   2 x 1.4e-7: 6 sigma = 7.5e-8. (An element whose gradient nearly cancels
#   can flip its update; the per-leaf max|leaf| scale, not the element's,
#   is what keeps that from counting.)
# So 1e-6 = 1.4 x the widest 6-sigma estimate. docs/tolerances.md has the
# worst measured under native (AVX-512) and AVX2 code: 3.8e-7, that family
# (fast-math, which approximates division, reaches 9.5e-7-1.0e-6). A lost,
# doubled or mis-scaled update is off by >= lr * G ~ 1e-3: three orders
# above the bound.
FP32_REORDER = 1e-6

# A loss or a gradient norm (a scalar: a sum of n <= 48 non-negative terms,
# 16 rows x 3 outputs, each from dot products of length <= 7) in another
# order: worst case (n - 1 + 2 * 7) * U32 = 3.6e-6 relative, a few ulps more
# for another CPU's tanh; 1e-5 = 2.7x that.
FP32_SCALAR_REORDER = 1e-5


# fp16 params, N=1: zero1's fp16 backward runs on loss * scale (a power of
# two: exact) and keeps 11 bits where the unscaled reference's values fall
# below fp16's normal range (2^-14) and round to the subnormal grid, an
# absolute error of up to FP16_SUBNORMAL_STEP / 2 per rounding. A kernel
# gradient element of the tanh model is sum_r x[r,i] * dpre[r,k] over R = 16
# rows, in fp16: each dpre carries up to 3 such roundings (dh, 1 - h^2, their
# product) scaled by |x| <= 3.33 (the test's batches), each product 1 more,
# and the running sum up to R - 1 more: R * (3 * 3.33 + 1) + 15 = 191
# half-steps. SGD (lr 0.1, momentum 0.9, 5 applied steps) moves a weight by
# at most 0.1 * momentum_gain(0.9, 5) = 1.31 gradient errors: 191 * 2^-25 *
# 1.31 = 7.5e-6 absolute, over the leaf's largest weight (>= 1.16 for the
# kernels; the biases have fewer roundings: 63 * 2^-25 * 1.31 / 0.72 =
# 3.4e-6): 6.4e-6. Measured: 5.2e-7 (AVX-512 code), 1.03e-6 (AVX2).
FP16_UNSCALED_REF = round(
    max((16 * (3 * 3.33 + 1) + 15) / 1.16, (16 * 3 + 15) / 0.72)
    * FP16_SUBNORMAL_STEP / 2 * 0.1 * momentum_gain(0.9, 5), 7)
