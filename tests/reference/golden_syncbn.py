"""SyncBatchNorm golden data: what torch.nn.SyncBatchNorm computes for 1, 2 and 3 ranks with
unequal batch sizes (one rank with an empty batch), without a process group.

torch 1.13 runs torch.nn.SyncBatchNorm on CUDA only, and its kernels (batch_norm_stats,
batch_norm_gather_stats_with_counts, batch_norm_backward_reduce, batch_norm_backward_elemt) have
no CPU implementation. So this module reproduces torch/nn/modules/_functions.py::SyncBatchNorm
step by step with CPU ops, in float64 on the float32 inputs (the exact values, up to float64
rounding), simulating the all_gather and all_reduce by stacking and summing the ranks' tensors:

  forward:  per rank mean, invstd = 1/sqrt(biased var + eps), count (zeros for an empty batch);
            all_gather; drop ranks with count < 1; Welford merge with counts as the CUDA kernel
            batch_norm_reduce_statistics_kernel does (var from invstd: 1/invstd^2 - eps);
            running_mean/var update with the unbiased variance; y = (x - mean) * invstd * w + b
  backward: per rank sum_dy, sum_dy_xmu; local grad_weight = sum_dy_xmu * invstd and
            grad_bias = sum_dy (not synchronised: DDP averages them); all_reduce(sum) of
            [sum_dy, sum_dy_xmu]; dx = (dy - sum_dy/n - (x - mean) * invstd^2 * sum_dy_xmu/n)
            * invstd * w with n the total count; an empty rank contributes zeros and gets no
            gradients (autograd reads None as zeros)

and VERIFIES it inside this script against plain torch.nn.functional.batch_norm on the
concatenated batch with autograd (in float64, to 1e-12 relative; and in float32 with torch's own
CPU kernels, to 1e-5), which is what SyncBatchNorm promises to equal. Eval mode (running stats)
and world size 1 are torch's F.batch_norm itself.

Keys (r = rank, s = training step from 0):
  CASE/config            world, channels, affine, momentum (-1 = None: cumulative average), eps,
                         steps
  CASE/r<r>/shape        that rank's input shape (N may be 0)
  CASE/weight, CASE/bias the affine parameters (absent when affine is off)
  CASE/s<s>/r<r>/{input,grad_output,output,grad_input,grad_weight,grad_bias}
                         grad_weight/grad_bias are that rank's local ones (zeros for an empty rank)
  CASE/s<s>/{running_mean,running_var,num_batches_tracked}   after step s
  CASE/eval/r<r>/{input,grad_output,output,grad_input,grad_weight,grad_bias}
                         eval mode after the last step (running statistics, no communication)
"""
import torch
import torch.nn.functional as F

EPS = 1e-5

# name, ranks' batch sizes, channels, spatial dims, affine, momentum (None: cumulative), steps
CASES = [
    ("r2", [3, 1], 3, [4], True, 0.1, 2),
    ("r2empty", [0, 5], 4, [], False, 0.1, 2),
    ("r3", [4, 0, 2], 2, [3, 2], True, None, 3),
    ("w1", [5], 3, [2, 2], True, 0.1, 2),
]


def _stats(x, eps):
    """torch.batch_norm_stats: per channel mean and invstd of the biased variance."""
    c = x.shape[1]
    flat = x.transpose(0, 1).reshape(c, -1)
    var, mean = torch.var_mean(flat, dim=1, unbiased=False)
    return mean, 1.0 / torch.sqrt(var + eps)


def _gather_stats_with_counts(mean_all, invstd_all, count_all, running_mean, running_var,
                              momentum, eps):
    """torch.batch_norm_gather_stats_with_counts (batch_norm_reduce_statistics_kernel)."""
    c = mean_all.shape[1]
    avg = torch.zeros(c, dtype=torch.float64)
    var_n = torch.zeros(c, dtype=torch.float64)
    n = 0.0
    for j in range(mean_all.shape[0]):
        count = float(count_all[j])
        m = mean_all[j]
        v = 1.0 / invstd_all[j]
        v = (v * v - eps) * count
        factor = 1.0 / (n + count)
        var_n = var_n + v + (avg - m) * (avg - m) * n * count * factor
        avg = n * factor * avg + count * factor * m
        n += count
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(momentum * avg)
        running_var.mul_(1 - momentum).add_(momentum * var_n / (n - 1))
    return avg, 1.0 / torch.sqrt(var_n / n + eps)


def _per_channel(v, ndim):
    return v.view([1, -1] + [1] * (ndim - 2))


def _sync_forward(xs, weight, bias, running_mean, running_var, momentum, eps):
    c = xs[0].shape[1]
    combined = []
    for x in xs:
        if x.numel() > 0:
            mean, invstd = _stats(x, eps)
            count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64)
            combined.append(torch.cat([mean, invstd, count]))
        else:
            combined.append(torch.zeros(2 * c + 1, dtype=torch.float64))
    gathered = torch.stack(combined)  # all_gather
    mean_all, invstd_all, count_all = torch.split(gathered, c, dim=1)
    mask = count_all.squeeze(-1) >= 1
    mean, invstd = _gather_stats_with_counts(mean_all[mask], invstd_all[mask],
                                             count_all[mask].view(-1), running_mean,
                                             running_var, momentum, eps)
    outputs = []
    for x in xs:
        y = (x - _per_channel(mean, x.dim())) * _per_channel(invstd, x.dim())
        if weight is not None:
            y = y * _per_channel(weight, x.dim()) + _per_channel(bias, x.dim())
        outputs.append(y)
    return outputs, mean, invstd, float(count_all[mask].sum())


def _sync_backward(xs, dys, weight, mean, invstd, total):
    c = xs[0].shape[1]
    local = []
    for x, dy in zip(xs, dys):
        if x.numel() > 0:
            dims = [d for d in range(x.dim()) if d != 1]
            xmu = x - _per_channel(mean, x.dim())
            local.append((dy.sum(dims), (dy * xmu).sum(dims)))
        else:
            local.append((torch.zeros(c, dtype=torch.float64),
                          torch.zeros(c, dtype=torch.float64)))
    sum_dy = sum(s for s, _ in local)  # all_reduce(sum)
    sum_dy_xmu = sum(s for _, s in local)
    w = weight if weight is not None else torch.ones(c, dtype=torch.float64)
    grads = []
    for (x, dy), (local_dy, local_dy_xmu) in zip(zip(xs, dys), local):
        d = x.dim()
        grad_mean = sum_dy / total
        proj_scale = sum_dy_xmu / total * invstd * invstd
        dx = (dy - _per_channel(grad_mean, d) -
              (x - _per_channel(mean, d)) * _per_channel(proj_scale, d)) * \
            _per_channel(invstd * w, d)
        grads.append((dx, local_dy_xmu * invstd, local_dy))
    return grads


def _check_close(what, got, want, rtol):
    scale = max(float(want.abs().max()), 1.0) if want.numel() else 1.0
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    if err > rtol * scale:
        raise AssertionError(f"syncbn: {what} differs from torch's BatchNorm by {err} "
                             f"(allowed {rtol * scale})")


def _plain_batch_norm(xs, dys, weight, bias, running_mean, running_var, training, momentum,
                      eps, dtype):
    """F.batch_norm with autograd on the concatenated batch: what SyncBatchNorm must equal."""
    x = torch.cat([t.to(dtype) for t in xs]).requires_grad_(True)
    w = b = None
    if weight is not None:
        w = weight.to(dtype).clone().requires_grad_(True)
        b = bias.to(dtype).clone().requires_grad_(True)
    y = F.batch_norm(x, running_mean, running_var, w, b, training, momentum, eps)
    (y * torch.cat([t.to(dtype) for t in dys])).sum().backward()
    return y.detach(), x.grad, (w.grad if w is not None else None), \
        (b.grad if b is not None else None)


def _split(t, sizes):
    return list(torch.split(t, sizes)) if t is not None else None


def _run_case(writer, gen, name, sizes, channels, spatial, affine, momentum, steps):
    world = len(sizes)
    writer.record(f"{name}/config", [world, channels, int(affine),
                                     -1.0 if momentum is None else momentum, EPS, steps])
    for r, n in enumerate(sizes):
        writer.record(f"{name}/r{r}/shape", [n, channels] + spatial)

    weight = bias = None
    if affine:
        weight = (0.5 + torch.rand(channels, generator=gen)).to(torch.float32)
        bias = torch.randn(channels, generator=gen).to(torch.float32)
        writer.record(f"{name}/weight", weight)
        writer.record(f"{name}/bias", bias)
    w64 = weight.double() if affine else None
    b64 = bias.double() if affine else None

    running_mean = torch.zeros(channels, dtype=torch.float64)
    running_var = torch.ones(channels, dtype=torch.float64)
    check_mean = running_mean.clone()  # the running statistics F.batch_norm keeps (float64)
    check_var = running_var.clone()
    check_mean32 = running_mean.float()
    check_var32 = running_var.float()
    tracked = 0
    # Channel offsets far from zero make the (x - mean) cancellation and the Welford merge matter.
    offsets = torch.linspace(-3.0, 5.0, channels).view([1, -1] + [1] * len(spatial))
    for step in range(steps):
        xs = [(torch.randn([n, channels] + spatial, generator=gen) * 2.0 + offsets).float()
              for n in sizes]
        dys = [torch.randn([n, channels] + spatial, generator=gen).float() for n in sizes]
        x64 = [x.double() for x in xs]
        dy64 = [dy.double() for dy in dys]
        tracked += 1
        factor = 1.0 / tracked if momentum is None else momentum

        outputs, mean, invstd, total = _sync_forward(x64, w64, b64, running_mean, running_var,
                                                     factor, EPS)
        grads = _sync_backward(x64, dy64, w64, mean, invstd, total)

        # Verify against plain batch norm on the concatenated batch: float64 exactly (up to
        # rounding), float32 with torch's own CPU kernels loosely.
        y, gx, gw, gb = _plain_batch_norm(x64, dy64, w64, b64, check_mean, check_var, True,
                                          factor, EPS, torch.float64)
        _check_close(f"{name} step {step} output", torch.cat(outputs), y, 1e-12)
        _check_close(f"{name} step {step} grad_input", torch.cat([g[0] for g in grads]), gx,
                     1e-12)
        if affine:
            _check_close(f"{name} step {step} grad_weight", sum(g[1] for g in grads), gw, 1e-12)
            _check_close(f"{name} step {step} grad_bias", sum(g[2] for g in grads), gb, 1e-12)
        _check_close(f"{name} step {step} running_mean", running_mean, check_mean, 1e-12)
        _check_close(f"{name} step {step} running_var", running_var, check_var, 1e-12)
        y32, gx32, gw32, gb32 = _plain_batch_norm(xs, dys, weight, bias, check_mean32,
                                                  check_var32, True, factor, EPS, torch.float32)
        _check_close(f"{name} step {step} float32 output", torch.cat(outputs), y32, 1e-5)
        _check_close(f"{name} step {step} float32 grad_input",
                     torch.cat([g[0] for g in grads]), gx32, 1e-5)
        if affine:
            _check_close(f"{name} step {step} float32 grad_weight", sum(g[1] for g in grads),
                         gw32, 1e-5)
        _check_close(f"{name} step {step} float32 running_var", running_var, check_var32, 1e-5)

        for r in range(world):
            prefix = f"{name}/s{step}/r{r}"
            writer.record(f"{prefix}/input", xs[r])
            writer.record(f"{prefix}/grad_output", dys[r])
            writer.record(f"{prefix}/output", outputs[r])
            writer.record(f"{prefix}/grad_input", grads[r][0])
            writer.record(f"{prefix}/grad_weight", grads[r][1] if affine else [])
            writer.record(f"{prefix}/grad_bias", grads[r][2] if affine else [])
        writer.record(f"{name}/s{step}/running_mean", running_mean)
        writer.record(f"{name}/s{step}/running_var", running_var)
        writer.record(f"{name}/s{step}/num_batches_tracked", [tracked])

    # Eval mode: each rank normalises with the running statistics on its own (F.batch_norm).
    for r, n in enumerate(sizes):
        x = (torch.randn([n, channels] + spatial, generator=gen) * 2.0 + offsets).float()
        dy = torch.randn([n, channels] + spatial, generator=gen).float()
        y, gx, gw, gb = _plain_batch_norm([x.double()], [dy.double()], w64, b64,
                                          running_mean.clone(), running_var.clone(), False,
                                          0.0, EPS, torch.float64)
        prefix = f"{name}/eval/r{r}"
        writer.record(f"{prefix}/input", x)
        writer.record(f"{prefix}/grad_output", dy)
        writer.record(f"{prefix}/output", y)
        writer.record(f"{prefix}/grad_input", gx)
        writer.record(f"{prefix}/grad_weight", gw if affine else [])
        writer.record(f"{prefix}/grad_bias", gb if affine else [])


def generate(writer):
    torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(20261121)
    writer.comment("SyncBatchNorm as torch/nn/modules/_functions.py::SyncBatchNorm computes it,")
    writer.comment("reproduced on the CPU in float64 from float32 inputs and verified against")
    writer.comment("F.batch_norm with autograd on the concatenated batch; see golden_syncbn.py.")
    for case in CASES:
        _run_case(writer, gen, *case)
