"""Whole-prompt causal attention on the Llama-1B shape (32 q heads, 8 kv heads, head 64, bf16): torch's flash varlen
(what zoo's prompt graphs call) against cuDNN's attention (ragged through cu_seq, and dense SDPA), timed with CUDA
events, checked against each other, and captured in a CUDA graph."""
import inspect, statistics
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn
print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())
causal = dict(window_size=(-1, 0)) if "window_size" in inspect.signature(varlen_attn).parameters else dict(is_causal=True)
H, KV, D = 32, 8, 64
scale = D ** -0.5

def timeit(fn, n=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)

for lens in ([2047], [2047, 1], [1024] * 16, [512] * 4, [100, 900, 1500, 37]):
    T = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    mx = max(lens)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16)
    flops = sum(2 * 2 * L * L * D * H / 2 for L in lens)
    def flash(): return varlen_attn(q, k, v, cu, cu, mx, mx, scale=scale, **causal)
    ref = flash()
    t = timeit(flash)
    print(f"{lens if len(lens) < 6 else f'{len(lens)}x{lens[0]}'}: flash varlen {1000*t:.0f} us ({flops/t/1e9:.0f} TFLOP/s)")
    kx = k.repeat_interleave(H // KV, dim=1); vx = v.repeat_interleave(H // KV, dim=1)
    def cudnn_ragged():
        return torch.ops.aten._cudnn_attention_forward(q, kx, vx, None, cu, cu, mx, mx, False, 0.0, True, False, scale=scale)[0]
    def cudnn_ragged_expand():
        kk = k.repeat_interleave(H // KV, dim=1); vv = v.repeat_interleave(H // KV, dim=1)
        return torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, mx, mx, False, 0.0, True, False, scale=scale)[0]
    for name, fn in (("cudnn ragged", cudnn_ragged), ("cudnn ragged + kv expand", cudnn_ragged_expand)):
        try:
            out = fn()
            err = (out.float() - ref.float()).abs().max().item()
            t = timeit(fn)
            print(f"   {name}: {1000*t:.0f} us ({flops/t/1e9:.0f} TFLOP/s), max |diff| vs flash {err:.4f}")
        except Exception as exc:
            print(f"   {name}: {type(exc).__name__}: {str(exc)[:300]}")
    if len(lens) == 1:
        qb, kb, vb = q[None].transpose(1, 2), kx[None].transpose(1, 2), vx[None].transpose(1, 2)
        for name, be in (("sdpa cudnn dense", SDPBackend.CUDNN_ATTENTION), ("sdpa flash dense", SDPBackend.FLASH_ATTENTION)):
            try:
                def fn():
                    with sdpa_kernel([be]):
                        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
                out = fn()[0].transpose(0, 1)
                err = (out.float() - ref.float()).abs().max().item()
                t = timeit(fn)
                print(f"   {name}: {1000*t:.0f} us ({flops/t/1e9:.0f} TFLOP/s), max |diff| {err:.4f}")
            except Exception as exc:
                print(f"   {name}: {type(exc).__name__}: {str(exc)[:300]}")
    # graph capture of the cuDNN ragged call
    try:
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2): cudnn_ragged()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gout = cudnn_ragged()
        q.copy_(torch.randn_like(q)); g.replay(); torch.cuda.synchronize()
        err = (gout.float() - flash().float()).abs().max().item()
        print(f"   cudnn ragged in a CUDA graph: replay with new q, max |diff| vs flash {err:.4f}")
    except Exception as exc:
        print(f"   cudnn graph: {type(exc).__name__}: {str(exc)[:300]}")
