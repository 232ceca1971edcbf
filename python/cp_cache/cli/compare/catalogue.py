"""What compare measures: the systems' names, the correctness cases and the thresholds."""

CP_CACHE = "cp_cache"
CP_CACHE_STACK = "cp_cache-stack"
NPU_214 = "torch_npu 2.14.0"
NPU_213 = "torch_npu 2.13.0"
NPU_213_LIFTED = "torch_npu 2.13.0 (guard lifted)"
NPU_212 = "torch_npu 2.12.0"
TORCH_AG = "torch ring (all-gather)"
TORCH_A2A = "torch ring (all-to-all)"
SYSTEMS = (CP_CACHE, CP_CACHE_STACK, NPU_214, NPU_213, NPU_213_LIFTED, NPU_212, TORCH_AG, TORCH_A2A)
SHORT = {CP_CACHE: "cp_cache", CP_CACHE_STACK: "cp_cache-stack", NPU_214: "npu-2.14", NPU_213: "npu-2.13",
         NPU_213_LIFTED: "npu-2.13-lifted", NPU_212: "npu-2.12", TORCH_AG: "torch-AG", TORCH_A2A: "torch-A2A"}
# the torch-npu release each torch_npu system loads (2.14.0's CP files equal 2.13.0's but for version.py)
TORCH_NPU_RELEASES = {NPU_214: "2.14.0", NPU_213: "2.13.0", NPU_213_LIFTED: "2.13.0", NPU_212: "2.12.0"}
# the lifted variant differs from 2.13.0 only under dropout: it runs the dropout check only
DROPOUT_ONLY = (NPU_213_LIFTED,)

# (a) the cases: mask "causal" = the compressed 2048x2048 triu mask, "all_false" = a full
# [S, S] bool mask with nothing masked (the right answer is full attention)
CASES = (
    dict(name="causal_lb", layout="BNSD", gqa=False, mask="causal", mode=2, lb=True,
         what="BNSD, sparse_mode 2 (compressed mask), load balancing (head-tail)"),
    dict(name="causal", layout="BNSD", gqa=False, mask="causal", mode=2, lb=False,
         what="BNSD, sparse_mode 2, contiguous shards"),
    dict(name="full", layout="BNSD", gqa=False, mask=None, mode=0, lb=False, what="BNSD, no mask (full attention)"),
    dict(name="gqa_causal_lb", layout="BNSD", gqa=True, mask="causal", mode=2, lb=True, what="GQA Nkv = N/2"),
    dict(name="bsnd_causal_lb", layout="BSND", gqa=False, mask="causal", mode=2, lb=True, what="layout BSND"),
    dict(name="bsh_causal_lb", layout="BSH", gqa=False, mask="causal", mode=2, lb=True, what="layout BSH"),
    dict(name="sbh_causal_lb", layout="SBH", gqa=False, mask="causal", mode=2, lb=True, what="layout SBH"),
    dict(name="sparse1_all_false_mask", layout="BNSD", gqa=False, mask="all_false", mode=1, lb=False,
         what="sparse_mode 1, full [S, S] mask all False (= full attention)"),
    dict(name="sparse3_causal_lb", layout="BNSD", gqa=False, mask="causal", mode=3, lb=True,
         what="sparse_mode 3 (right-down causal), compressed mask"),
)
DROPOUT_CASE = dict(name="dropout_causal_lb", layout="BNSD", gqa=False, mask="causal", mode=2, lb=True,
                    keep_prob=0.9, what="keep_prob 0.9, causal, load balancing")
WRONG_ABOVE = 1e-3  # an accepted case with a larger max relative error is silently wrong (fp32 inputs)
DROPOUT_OK_BELOW = 1e-2  # directional-derivative error of a right gradient (validated on one process)
RNG_SEED = 1000  # dropout draws: torch.manual_seed(RNG_SEED + rank) before each forward
