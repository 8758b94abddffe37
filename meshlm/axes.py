"""The logical axes: the names the model gives its dimensions, and the layouts of the arrays it pins.

Names only. Where each name lives on the mesh is a strategy's business (`meshlm.strategy`), and
turning names into PartitionSpecs is `meshlm.sharding`'s; model code writes `sharding.constrain(x,
axes.STREAM)` and never a mesh axis.

Shapes: B batch, T length, S cache length, E d_model, H heads, K kv heads, D head_dim, M mlp_dim,
V vocab, r a LoRA adapter's rank.
"""

LOGICAL_AXES = (
    "batch",
    "length",
    "cache_length",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "layers",
    "lora_rank",
)

# ------------------------------------------------------------------------------------- activations

TOKENS = ("batch", "length")  # [B, T] token ids, positions, segment ids, targets, loss mask
STREAM = ("batch", "length", "embed")  # [B, T, E] the residual stream
QUERIES = ("batch", "length", "heads", "head_dim")  # [B, T, H, D] queries and the attention output
KEYS = ("batch", "length", "kv_heads", "head_dim")  # [B, T, K, D] keys and values
KV_CACHE = ("batch", "cache_length", "kv_heads", "head_dim")  # [B, S, K, D] one layer's cached keys or values
HIDDEN = ("batch", "length", "mlp")  # [B, T, M] the MLP's hidden activations
LOGITS = ("batch", "length", "vocab")  # [B, T, V]

# -------------------------------------------------------------------------------------- parameters

EMBED_TABLE = ("vocab", "embed")  # [V, E] token embedding
HEAD = ("embed", "vocab")  # [E, V] output projection (untied)
NORM = ("embed",)  # [E] RMSNorm scale
WQ = ("embed", "heads", "head_dim")  # [E, H, D]
WKV = ("embed", "kv_heads", "head_dim")  # [E, K, D] key and value projections
WO = ("heads", "head_dim", "embed")  # [H, D, E]
MLP_IN = ("embed", "mlp")  # [E, M] gate and up projections
MLP_OUT = ("mlp", "embed")  # [M, E] down projection

# LoRA adapters (meshlm.models.lora) keep their weight's axes on either side of the rank: A is the weight's
# input axes + LORA_RANK, B is LORA_RANK + its output axes (wq's A [E, r] and B [r, H, D]).
LORA_RANK = "lora_rank"  # r: always whole (replicated) in every strategy
