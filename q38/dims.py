"""The dimension legend, shared by jaxtyping strings, einsum equations, variable suffixes and spec tables.

| letter | meaning                                   |
|--------|-------------------------------------------|
| b      | batch                                     |
| s      | query / current positions                 |
| t      | key/value positions                       |
| n      | flattened tokens (b·s)                    |
| d      | model width (hidden_size)                 |
| f      | FFN hidden (dense, shared or per expert)  |
| h      | query heads (or GDN value heads)          |
| g      | kv heads (attention)                      |
| hk     | GDN key heads                             |
| c      | head dim                                  |
| e      | routed experts (global)                   |
| k      | top-k                                     |
| m      | routed slots (n·k)                        |
| v      | vocab                                     |
| l      | stacked layers                            |
| p      | recurrent / linear-attention state size   |
| w      | convolution window (kernel size)          |

The GDN core's functions take the per-head log-decay gate as ``g`` (flash-linear-attention's name for it), so in
``q38/layers/gdn.py`` GDN key heads are written ``hk``, never ``g``.

Shard-local sizes get multi-letter names (``el`` = local experts), because DTensor shapes are global.
"""
