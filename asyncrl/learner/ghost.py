"""Per-trajectory squared gradient norms from one batched backward (no sockets): what VCPO's
off-policy optimal baseline weighs each trajectory by (W_i = ||h_i||^2, ALGORITHMS.md 2.2),
without a backward per trajectory.

The technique is DP-SGD's "ghost norm" (Goodfellow 2015; Li et al. 2021, Opacus): a linear layer's
weight gradient for row b is G_b^T X_b (X its inputs, G its output gradients over b's tokens), so

    ||G_b^T X_b||^2 = sum_{t,s} (x_t . x_s)(g_t . g_s)

needs only [L, L] Gram matrices of activations the backward has anyway, never the per-row
gradient itself. Rows are independent in a right-padded forward (no shared prefix: a shared
token's gradient would mix rows), and padding positions carry zero output gradient. The other
parameters of a Llama/Qwen2-style decoder, each exactly:

* an RMSNorm weight w (y = w * n(x)): row b's gradient sum_t g_t * n(x_t), recomputed from x;
* a linear bias: sum_t g_t;
* the LM head W, applied inside the fused log-prob kernel: row b's gradient is
  sum_t c_t d_t h_t^T with h_t the final hidden state, c_t = d loss / d logp_t and
  d_t = (onehot(y_t) - p_t) / tau, so ||.||^2 = sum_{t,s} c_t c_s (d_t . d_s)(h_t . h_s), where
  d_t . d_s = ([y_t = y_s] - p_t[y_s] - p_s[y_t] + p_t . p_s) / tau^2 (computed in the forward, where
  the head's weight is at hand: [L, L] matrices, no [L, V] tensor kept);
* the token embedding E: row b's gradient scatters its output gradients G_s to rows x_s:
  ||.||^2 = sum_{s,s'} [x_s = x_s'] G_s . G_s'; tied to the head, the two add, and the cross term
  2 sum_{s,t} c_t d_t[x_s] (G_s . h_t) joins them.

Any other parameterised module, a nucleus (top_p < 1) or a head bias is refused (`unsupported`),
and the learner keeps the per-trajectory backward. Exactness against per-trajectory backwards:
`tests/unit/test_ghost_norms.py` (float64, 1e-9).

The same backward also trains (`capture=True`, then `grads(k_B)`): the pieces the norms read (each
layer's inputs and output gradients at A = +1) are kept, and once the advantages are known the
step's gradient sum_b k_b h_b is formed from them layer by layer (a linear layer's
sum_b k_b G_b^T X_b is one matrix product, as in any backward), so the optimal baseline costs one
forward and one backward. Exact because the loss is linear in each row's advantage: row b's output
gradients under advantage k_b are k_b times those at +1 (rows do not interact in a right-padded
forward). Hooks act only for the thread that activated them (`active`), so pieces of a batch run
concurrently on the learner's data-parallel threads.

Legend: B rows, L padded length, S = L - 1 predicted positions, D hidden size, V vocab.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from asyncrl.learner.parallel import full_tensor

# Rows x positions x vocab of head probabilities computed at once in the forward hook.
HEAD_CHUNK_ELEMENTS = 1 << 22

# The collector whose hooks act in this thread (`GhostNorms.active`).
_ACTIVE = threading.local()


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def unsupported(lm: torch.nn.Module, *, top_p: float) -> str | None:
    """Why per-trajectory norms cannot be taken from a batched backward of `lm`; None if they can."""
    if top_p != 1.0:
        return f"sampling.top_p = {top_p} (the head's per-token gradient is renormalised over a nucleus)"
    head, emb = lm.get_output_embeddings(), lm.get_input_embeddings()
    if getattr(head, "bias", None) is not None:
        return "the LM head has a bias"
    decoder = lm.get_decoder()
    if not _is_rms_norm(getattr(decoder, "norm", None) or torch.nn.Identity()):
        return "the decoder has no final RMSNorm named 'norm'"
    for name, module in lm.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own or module is head or module is emb:
            continue
        if isinstance(module, torch.nn.Linear) or _is_rms_norm(module):
            continue
        return f"module {name} ({type(module).__name__}) has parameters the ghost norms do not cover"
    return None


class GhostNorms:
    """Collects per-row squared gradient norms over one forward and one backward of `lm`.

    Use: `with GhostNorms(lm, temperature) as g:` run the forward (rows [B, L]), then
    `g.backward(logp_BL, coeff_BL)` with the loss's gradient on the log-probs; `g.norms_B` is
    then ||h_b||^2 for every row b (float64). With `capture`, `g.grads(k_B)` then gives the
    gradient of sum_b k_b (the loss of row b at +1) for every parameter. Entering activates the
    hooks for the entering thread; another thread's forward runs under `with g.active():`."""

    def __init__(self, lm: torch.nn.Module, *, temperature: float, capture: bool = False) -> None:
        self.lm = lm
        self.capture = capture
        # (parameter owner, what its gradient is formed from): filled in the backward
        self.kept: list[tuple[str, torch.nn.Module, torch.Tensor, list]] = []
        self.coeff_BL: torch.Tensor | None = None
        self.g_emb: torch.Tensor | None = None
        # id of a linear layer's input -> (the input, its Gram matrices): q/k/v and gate/up share one
        self._x_grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (input, detached)
        self.temperature = temperature
        self.head = lm.get_output_embeddings()
        self.emb = lm.get_input_embeddings()
        self.tied = self.head.weight is self.emb.weight
        self.handles: list = []
        self.norms_B: torch.Tensor | None = None
        self.ids_BL: torch.Tensor | None = None
        self.emb_out: torch.Tensor | None = None
        self.head_parts: dict[str, torch.Tensor] = {}

    def __enter__(self) -> GhostNorms:
        for module in self.lm.modules():
            if isinstance(module, torch.nn.Linear) and module is not self.head:
                self.handles.append(module.register_forward_hook(self._linear_hook))
            elif _is_rms_norm(module):
                self.handles.append(module.register_forward_hook(self._norm_hook))
        self.handles.append(self.emb.register_forward_hook(self._emb_hook))
        self.handles.append(self.lm.get_decoder().norm.register_forward_hook(self._final_hook))
        _ACTIVE.ghost = self
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if getattr(_ACTIVE, "ghost", None) is self:
            _ACTIVE.ghost = None

    @contextlib.contextmanager
    def active(self):
        """This collector's hooks act for forwards run in this thread (and no other's do)."""
        before = getattr(_ACTIVE, "ghost", None)
        _ACTIVE.ghost = self
        try:
            yield self
        finally:
            _ACTIVE.ghost = before

    def _mine(self) -> bool:
        return getattr(_ACTIVE, "ghost", None) is self

    # ------------------------------------------------------------------ forward hooks
    def _add(self, values_B: torch.Tensor) -> None:
        values_B = values_B.detach().double()
        self.norms_B = values_B if self.norms_B is None else self.norms_B + values_B

    def _on_grad(
        self, out: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], keep: tuple | None = None
    ) -> None:
        """On `out`'s gradient g: add fn(g) to the norms; with `capture`, keep g with `keep`
        (kind, module, what the parameter gradient is formed from)."""
        if not out.requires_grad:
            return
        grads: list = []
        if self.capture and keep is not None:
            self.kept.append((*keep, grads))

        def on(g: torch.Tensor) -> None:
            g = g.detach()
            self._add(fn(g))
            if self.capture:
                grads.append(g)

        out.register_hook(on)

    def _linear_hook(self, module, inputs, out) -> None:
        if not self._mine():
            return
        x = self._inputs.setdefault(id(inputs[0]), (inputs[0], inputs[0].detach()))[1]  # one per shared input
        has_bias = module.bias is not None and module.bias.requires_grad

        def per_row(g: torch.Tensor) -> torch.Tensor:
            total = _gram_product(x, g, self._x_grams)
            if has_bias:
                total = total + g.sum(1).square().sum(-1)
            return total

        if module.weight.requires_grad or has_bias:
            self._on_grad(out, per_row, ("linear", module, x))

    def _norm_hook(self, module, inputs, out) -> None:
        if not self._mine():
            return
        x = inputs[0].detach()
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # as HF's RMSNorm (float32 at least)
        n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(x.dtype)
        if module.weight.requires_grad:
            self._on_grad(out, lambda g: (g * n).sum(1).square().sum(-1), ("norm", module, n))

    def _emb_hook(self, module, inputs, out) -> None:
        if not self._mine():
            return
        self.ids_BL = inputs[0].detach()
        self.emb_out = out  # its gradient is asked for by `backward`

    def _final_hook(self, module, inputs, out) -> None:
        """The head's Gram pieces, while its weight is at hand (inside the forward)."""
        if not self._mine():
            return
        weight = full_tensor(self.head.weight.detach())  # a gather on a sharded root: every rank
        h = out.detach()[:, :-1]  # [B, S, D]: the hidden states the head reads
        ids = self.ids_BL
        y, x = ids[:, 1:], ids
        rows, s = y.shape
        dtype = torch.promote_types(h.dtype, torch.float32)
        tau = self.temperature
        step = max(1, HEAD_CHUNK_ELEMENTS // max(1, s * weight.shape[0]))
        dd, dx = [], []
        for a in range(0, rows, step):
            hb = h[a : a + step].to(dtype)
            p = torch.softmax((hb @ weight.to(dtype).T) / tau, dim=-1)  # [b, S, V]
            yb, xb = y[a : a + step], x[a : a + step]
            py = torch.gather(p, 2, yb[:, None, :].expand(-1, s, -1))  # p_t[y_s]
            eq = (yb[:, :, None] == yb[:, None, :]).to(dtype)
            dd.append((eq - py - py.transpose(1, 2) + p @ p.transpose(1, 2)) / tau**2)
            px = torch.gather(p, 2, xb[:, None, :].expand(-1, s, -1))  # p_t[x_s]: [b, S, L]
            dx.append(((yb[:, :, None] == xb[:, None, :]).to(dtype) - px) / tau)
        self.head_parts = {"h": h.to(dtype), "dd": torch.cat(dd), "dx": torch.cat(dx)}

    # ------------------------------------------------------------------ backward
    def backward(self, logp_BL: torch.Tensor, coeff_BL: torch.Tensor) -> torch.Tensor:
        """Run the backward of sum(coeff * logp) to the embedding's output (no parameter
        gradients are formed) and return ||h_b||^2 per row [B] (float64)."""
        self.norms_B = None
        (g_emb,) = torch.autograd.grad(logp_BL, [self.emb_out], grad_outputs=coeff_BL)
        if self.capture:
            self.coeff_BL, self.g_emb = coeff_BL.detach(), g_emb.detach()
        parts = self.head_parts
        h, dd, dx = parts["h"], parts["dd"], parts["dx"]
        c = coeff_BL.detach()[:, 1:].to(h.dtype)  # c_t of position t's target, read from h_(t-1)
        hh = h @ h.transpose(1, 2)
        head = ((c[:, :, None] * c[:, None, :]) * dd * hh).sum((1, 2))
        g = g_emb.detach().to(h.dtype)
        ids = self.ids_BL
        emb = ((ids[:, :, None] == ids[:, None, :]).to(h.dtype) * (g @ g.transpose(1, 2))).sum((1, 2))
        total = head + emb
        if self.tied:
            gh = g @ h.transpose(1, 2)  # [B, L, S]: G_s . h_t
            total = total + 2 * (c[:, :, None] * dx * gh.transpose(1, 2)).sum((1, 2))
        self._add(total)
        return self.norms_B

    # ------------------------------------------------------------------ the step's gradient
    def grads(self, k_B: torch.Tensor) -> dict[torch.nn.Parameter, torch.Tensor]:
        """The gradient of sum_b k_b l_b for every trained parameter (l_b row b's loss as
        `backward` took it), from what the forward and the backward kept (`capture`): a linear
        layer's sum_b k_b G_b^T X_b, a bias's and an RMSNorm weight's sums, the embedding's
        scatter of k_b G_s, the head's sum_t k_b c_t d_t h_t^T (tied: the two add)."""
        out: dict[torch.nn.Parameter, torch.Tensor] = {}

        def add(param: torch.nn.Parameter | None, grad: torch.Tensor) -> None:
            if param is None or not param.requires_grad:
                return
            grad = grad.to(param.dtype)
            out[param] = grad if param not in out else out[param] + grad

        scaled: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(input) -> (input, k_b x_b)
        for kind, module, kept, (g,) in self.kept:
            if id(kept) not in scaled:  # a layer's input, or an RMSNorm's n(x): scaled once
                scaled[id(kept)] = (kept, kept.to(g.dtype) * k_B.to(g.dtype).view(-1, *([1] * (g.dim() - 1))))
            xk = scaled[id(kept)][1]
            if kind == "linear":
                add(module.weight, g.flatten(0, -2).T @ xk.flatten(0, -2))
                if module.bias is not None:
                    add(module.bias, (g * k_B.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))).sum((0, 1)))
            else:  # an RMSNorm weight: y = w * n(x)
                add(module.weight, (g * xk).flatten(0, -2).sum(0))
        g = self.g_emb * k_B.to(self.g_emb.dtype)[:, None, None]
        emb = torch.zeros(self.emb.weight.shape, dtype=g.dtype, device=g.device)
        add(self.emb.weight, emb.index_add_(0, self.ids_BL.flatten(), g.flatten(0, 1)))
        add(self.head.weight, self._head_grad(k_B))
        return out

    def _head_grad(self, k_B: torch.Tensor) -> torch.Tensor:
        """sum_{b,t} k_b c_t (onehot(y_t) - p_t) h_t^T / tau: the fused head's weight gradient,
        its probabilities recomputed in chunks of rows (no [B, S, V] tensor kept)."""
        h = self.head_parts["h"]
        weight = self.head.weight.detach().to(h.dtype)
        y = self.ids_BL[:, 1:]
        c = self.coeff_BL[:, 1:].to(h.dtype) * k_B.to(h.dtype)[:, None]
        rows, s = y.shape
        grad = torch.zeros(weight.shape, dtype=h.dtype, device=h.device)
        step = max(1, HEAD_CHUNK_ELEMENTS // max(1, s * weight.shape[0]))
        for a in range(0, rows, step):
            hb, cb = h[a : a + step], c[a : a + step, :, None]
            d = torch.softmax((hb @ weight.T) / self.temperature, dim=-1).mul_(-cb)
            d.scatter_add_(2, y[a : a + step, :, None], cb)  # c_t (onehot(y_t) - p_t)
            grad.add_(d.flatten(0, 1).T @ hb.flatten(0, 1))
        return grad / self.temperature


def _gram_product(x: torch.Tensor, g: torch.Tensor, x_grams: dict | None = None) -> torch.Tensor:
    """sum_{t,s} (x_t . x_s)(g_t . g_s) per row: ||g_b^T x_b||^2, by Gram matrices when the
    rows are short, else by forming each row's [din, dout] gradient (whichever is cheaper).
    `x_grams` caches x's Gram matrices for layers that share an input."""
    length, din, dout = x.shape[1], x.shape[-1], g.shape[-1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    if length * length <= din * dout:
        found = None if x_grams is None else x_grams.get(id(x))
        if found is None:
            xf = x.to(dtype)
            found = (x, xf @ xf.transpose(1, 2))
            if x_grams is not None:
                x_grams[id(x)] = found  # keeps x alive: its id is not reused meanwhile
        g = g.to(dtype)
        return (found[1] * (g @ g.transpose(1, 2))).sum((1, 2))
    x, g = x.to(dtype), g.to(dtype)
    return torch.einsum("bld,ble->bde", x, g).square().sum((1, 2))
