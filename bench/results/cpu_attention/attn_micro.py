import torch, time, torch.nn.functional as F
torch.set_num_threads(1)
B, nb, bs, H, G, D = 64, 8, 16, 2, 2, 32
num_blocks = 4096
kc = torch.randn(num_blocks, bs, H, D); vc = torch.randn(num_blocks, bs, H, D)
bt = torch.randint(0, num_blocks, (B, nb))
ctx = torch.randint(60, nb * bs, (B,))
q = torch.randn(B, H * G, D)
key_index = torch.arange(nb * bs)
mask = (key_index < ctx[:, None])[:, None, None]
def cur():
    keys = kc[bt].flatten(1, 2).transpose(1, 2); values = vc[bt].flatten(1, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, None].transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True).transpose(1, 2)[:, 0]
def gather_only():
    return kc[bt], vc[bt]
def manual():
    keys = kc[bt].view(B, nb * bs, H, D); values = vc[bt].view(B, nb * bs, H, D)
    qg = q.view(B, H, G, D)
    s = torch.einsum("bhgd,blhd->bhgl", qg, keys) * D ** -0.5
    s = s.masked_fill(~mask.view(B, 1, 1, -1), float("-inf"))
    p = s.softmax(-1)
    return torch.einsum("bhgl,blhd->bhgd", p, values).reshape(B, H * G, D)
def kvfirst():
    # cache laid out [blocks, H, bs, D]: gather gives [B, nb, H, bs, D]
    pass
print((cur() - manual()).abs().max())
for f in (cur, gather_only, manual):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(200): f()
    print(f.__name__, (time.perf_counter() - t) / 200 * 1e6, "us")
flat = bt.flatten()
kbuf = torch.empty(B * nb, bs, H, D); vbuf = torch.empty(B * nb, bs, H, D)
def isel():
    return kc.index_select(0, flat), vc.index_select(0, flat)
def isel_out():
    torch.index_select(kc, 0, flat, out=kbuf); torch.index_select(vc, 0, flat, out=vbuf)
kv = torch.stack([kc, vc], 1)  # [blocks, 2, bs, H, D]
def isel_joint():
    return kv.index_select(0, flat)
def cur_isel():
    keys = kc.index_select(0, flat).view(B, nb * bs, H, D).transpose(1, 2); values = vc.index_select(0, flat).view(B, nb * bs, H, D).transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, None].transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True).transpose(1, 2)[:, 0]
def sdpa_only(keys=kc[bt].flatten(1, 2).transpose(1, 2), values=vc[bt].flatten(1, 2).transpose(1, 2)):
    return F.scaled_dot_product_attention(q[:, None].transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
kcont = kc[bt].flatten(1, 2).transpose(1, 2).contiguous(); vcont = vc[bt].flatten(1, 2).transpose(1, 2).contiguous()
def sdpa_contig():
    return F.scaled_dot_product_attention(q[:, None].transpose(1, 2), kcont, vcont, attn_mask=mask, enable_gqa=True)
def sdpa_nomask():
    return F.scaled_dot_product_attention(q[:, None].transpose(1, 2), kcont, vcont, enable_gqa=True)
fmask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
def sdpa_fmask():
    return F.scaled_dot_product_attention(q[:, None].transpose(1, 2), kcont, vcont, attn_mask=fmask, enable_gqa=True)
for f in (isel, isel_out, isel_joint, cur_isel, sdpa_only, sdpa_contig, sdpa_nomask, sdpa_fmask):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(200): f()
    print(f.__name__, (time.perf_counter() - t) / 200 * 1e6, "us")
print("---compute")
kblhd = kc.index_select(0, flat).view(B, nb * bs, H, D); vblhd = vc.index_select(0, flat).view(B, nb * bs, H, D)
addmask = torch.zeros(B, 1, 1, nb * bs).masked_fill(~mask, float("-inf"))
def mm_strided():
    qg = q.view(B, H, G, D) * D ** -0.5
    s = torch.matmul(qg, kblhd.permute(0, 2, 3, 1)) + addmask
    p = s.softmax(-1)
    return torch.matmul(p, vblhd.transpose(1, 2)).view(B, H * G, D)
def mm_baddbmm():
    qg = (q.view(B, H, G, D) * D ** -0.5).reshape(B * H, G, D)
    k = kblhd.permute(0, 2, 3, 1).reshape(B * H, D, nb * bs)
    s = torch.baddbmm(addmask.expand(B, H, G, nb * bs).reshape(B * H, G, nb * bs), qg, k)
    p = s.softmax(-1)
    return torch.bmm(p, vblhd.transpose(1, 2).reshape(B * H, nb * bs, D)).view(B, H * G, D)
def sdpa_isel():
    return F.scaled_dot_product_attention(q[:, None].transpose(1, 2), kblhd.transpose(1, 2), vblhd.transpose(1, 2), attn_mask=mask, enable_gqa=True).transpose(1, 2)[:, 0]
ref = cur()
for f in (mm_strided, mm_baddbmm, sdpa_isel):
    print(f.__name__, (f() - ref).abs().max().item())
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(200): f()
    print(f.__name__, (time.perf_counter() - t) / 200 * 1e6, "us")
print("---1d")
slots = torch.randint(0, num_blocks * bs, (4096,))
kf = kc.view(-1, H, D)
def adv1d(): return kf[slots]
def isel1d(): return kf.index_select(0, slots)
for f in (adv1d, isel1d):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(200): f()
    print(f.__name__, (time.perf_counter() - t) / 200 * 1e6, "us")
print("---packed")
def sdpa_packed():
    return F.scaled_dot_product_attention(q.view(B, H, G, D), kblhd.transpose(1, 2), vblhd.transpose(1, 2), attn_mask=mask).reshape(B, H * G, D)
ref = sdpa_isel()
for f in (sdpa_isel, sdpa_packed):
    print(f.__name__, (f() - ref).abs().max().item())
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(300): f()
    print(f.__name__, (time.perf_counter() - t) / 300 * 1e6, "us")
