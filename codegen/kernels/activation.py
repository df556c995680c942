"""Expert activations as `@triton.jit` helpers, inlined into the GEMM epilogues.

The activation is a `tl.constexpr` integer code (the table lives in `codegen.launch`, in the
order of `codegen.activations.ACTIVATIONS`):

    0 swiglu      silu(g) * u
    1 geglu       gelu_erf(g) * u
    2 geglu_tanh  gelu_tanh(g) * u
    3 swiglu_oai  (u' + 1) * g' * sigmoid(alpha g'),  g' = min(g, limit), u' = clamp(u, +-limit)
    4 relu2       relu(h)^2           (non-gated: `u` is ignored)
    5 gelu        gelu_erf(h)
    6 silu        silu(h)
    7 swiglu_clamp  silu(g') * u',  g' = min(g, limit), u' = clamp(u, +-limit)   (DeepSeek-V4)
    8 swiglu_softcap  alpha tanh(g / alpha) * sigmoid(g) * limit tanh(u / limit)   (Inkling2)
    9 relu        relu(h)             (non-gated; no gradient at 0, as torch's)
    10 gelu_tanh  gelu_tanh(h)        (non-gated)
    11 reglu      relu(g) * u         (no gradient through g at 0, as torch's relu)
    15 identity   h               (internal: lets the up-projection kernel serve as a plain gathered GEMM)

Everything here is float32 math on float32 tiles; the callers upcast H and downcast the results.
The formulas mirror `codegen.activations.torch_activation_and_grad` term by term.
"""
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1: one portable formula for the GPU and the interpreter.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _unary_fwd(x, KIND: tl.constexpr):
    """KIND: 0 silu, 1 gelu_erf, 2 gelu_tanh, 4 relu^2."""
    if KIND == 0:
        y = x * tl.sigmoid(x)
    elif KIND == 1:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif KIND == 2:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (1.0 + _tanh(inner))
    else:
        r = tl.maximum(x, 0.0)
        y = r * r
    return y


@triton.jit
def _unary_fwd_and_grad(x, KIND: tl.constexpr):
    """(f(x), f'(x)) for the KIND codes of `_unary_fwd`."""
    if KIND == 0:
        s = tl.sigmoid(x)
        y = x * s
        dy = s * (1.0 + x * (1.0 - s))
    elif KIND == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        y = x * cdf
        dy = cdf + x * pdf
    elif KIND == 2:
        c = 0.7978845608028654
        t = _tanh(c * (x + 0.044715 * x * x * x))
        y = 0.5 * x * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
    else:
        r = tl.maximum(x, 0.0)
        y = r * r
        dy = 2.0 * r
    return y, dy


@triton.jit
def _act_fwd(g, u, alpha, limit, ACTIVATION: tl.constexpr):
    """A = act(g, u) in float32; for non-gated activations `g` is H and `u` is ignored."""
    if ACTIVATION == 3:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        a = (uc + 1.0) * (gc * tl.sigmoid(alpha * gc))
    elif ACTIVATION == 0:
        a = g * tl.sigmoid(g) * u
    elif ACTIVATION == 1:
        a = _unary_fwd(g, 1) * u
    elif ACTIVATION == 2:
        a = _unary_fwd(g, 2) * u
    elif ACTIVATION == 4:
        a = _unary_fwd(g, 4)
    elif ACTIVATION == 5:
        a = _unary_fwd(g, 1)
    elif ACTIVATION == 6:
        a = _unary_fwd(g, 0)
    elif ACTIVATION == 7:
        gc = tl.minimum(g, limit)
        a = gc * tl.sigmoid(gc) * tl.minimum(tl.maximum(u, -limit), limit)
    elif ACTIVATION == 8:
        a = alpha * _tanh(g / alpha) * tl.sigmoid(g) * (limit * _tanh(u / limit))
    elif ACTIVATION == 9:
        a = tl.maximum(g, 0.0)
    elif ACTIVATION == 10:
        a = _unary_fwd(g, 2)
    elif ACTIVATION == 11:
        a = tl.maximum(g, 0.0) * u
    else:
        a = g
    return a


@triton.jit
def _act_bwd(g, u, da, alpha, limit, ACTIVATION: tl.constexpr):
    """(A, dG, dU) with A = act(g, u), dG = dA * dA/dg, dU = dA * dA/du (dU is 0 when non-gated)."""
    if ACTIVATION == 3:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sg = tl.sigmoid(alpha * gc)
        glu = gc * sg
        a = (uc + 1.0) * glu
        # torch.clamp passes the gradient where the bound is not exceeded (bounds inclusive)
        dg = tl.where(g <= limit, da * (uc + 1.0) * (sg + alpha * gc * sg * (1.0 - sg)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), da * glu, 0.0)
    elif ACTIVATION == 0:
        s = tl.sigmoid(g)
        act_g = g * s
        a = act_g * u
        dg = da * u * (s * (1.0 + g * (1.0 - s)))
        du = da * act_g
    elif ACTIVATION == 7:
        act_g, dact_g = _unary_fwd_and_grad(tl.minimum(g, limit), 0)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        a = act_g * uc
        dg = tl.where(g <= limit, da * uc * dact_g, 0.0)
        du = tl.where((u >= -limit) & (u <= limit), da * act_g, 0.0)
    elif ACTIVATION == 8:
        tg = _tanh(g / alpha)
        tu = _tanh(u / limit)
        cg = alpha * tg
        cu = limit * tu
        sg = tl.sigmoid(g)
        a = cg * sg * cu
        dg = da * cu * sg * ((1.0 - tg * tg) + cg * (1.0 - sg))
        du = da * cg * sg * (1.0 - tu * tu)
    elif ACTIVATION == 1:
        act_g, dact_g = _unary_fwd_and_grad(g, 1)
        a = act_g * u
        dg = da * u * dact_g
        du = da * act_g
    elif ACTIVATION == 2:
        act_g, dact_g = _unary_fwd_and_grad(g, 2)
        a = act_g * u
        dg = da * u * dact_g
        du = da * act_g
    elif ACTIVATION == 11:
        act_g = tl.maximum(g, 0.0)
        a = act_g * u
        dg = tl.where(g > 0.0, da * u, 0.0)
        du = da * act_g
    else:
        if ACTIVATION == 4:
            a, dact = _unary_fwd_and_grad(g, 4)
        elif ACTIVATION == 5:
            a, dact = _unary_fwd_and_grad(g, 1)
        elif ACTIVATION == 9:
            a = tl.maximum(g, 0.0)
            dact = tl.where(g > 0.0, 1.0, 0.0)
        elif ACTIVATION == 10:
            a, dact = _unary_fwd_and_grad(g, 2)
        else:
            a, dact = _unary_fwd_and_grad(g, 0)
        dg = da * dact
        du = dg * 0.0
    return a, dg, du
