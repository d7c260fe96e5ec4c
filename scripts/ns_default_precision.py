"""Muon's Newton-Schulz under the TPU's `default` matmul precision, emulated on CPU (issue 36,
BENCHMARKS "Roofline, session 19"): every product's operands rounded to bf16, float32 accumulation.
The quintic step as `a x + (b A + c A^2) x` (the old form, its `a x` exact in float32) and as one
product `(a I + b A + c A^2) x` (torch_model/optim.py), and all in bf16, each against a float64
run: relative error and the range of the singular values.

    python scripts/ns_default_precision.py
"""
import torch

A, B, C = 3.4445, -4.7750, 2.0315
SHAPES = [(768, 2048), (2048, 2048), (384, 2048)]     # Lyra Small's Muon matrices (wide orientation)


def bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


def product(p, q):
    """`default` precision: one bf16 pass, float32 accumulation."""
    return bf16(p) @ bf16(q)


def newton_schulz(x, form: str):
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    eye = torch.eye(x.shape[-2], dtype=x.dtype)
    for _ in range(5):
        if form == "float64":
            gram = x @ x.mT
            x = A * x + (B * gram + C * gram @ gram) @ x
        elif form == "a x + B x":
            gram = product(x, x.mT)
            x = A * x + product(B * gram + C * product(gram, gram), x)
        elif form == "(a I + B) x":
            gram = product(x, x.mT)
            x = product(B * gram + C * product(gram, gram) + A * eye, x)
        else:                                                         # all bf16
            xb = x.bfloat16()
            gram = xb @ xb.mT
            x = (A * xb + (B * gram + C * gram @ gram) @ xb).float()
    return x


def main() -> None:
    torch.manual_seed(0)
    for shape in SHAPES:
        g = torch.randn(4, *shape, dtype=torch.float64)
        want = newton_schulz(g, "float64")
        for form in ("a x + B x", "(a I + B) x", "bf16"):
            got = newton_schulz(g.float(), form).double()
            err = ((got - want).norm() / want.norm()).item()
            sv = torch.linalg.svdvals(got[0])
            print(f"{str(shape):13} {form:12} relative error {err:.2e}   "
                  f"singular values {sv.min():.3f}..{sv.max():.3f}")


if __name__ == "__main__":
    main()
