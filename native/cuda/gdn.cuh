/* gdn.cuh: what gdn.cu (token by token) and gdn_chunk.cu (chunked) share. */
#ifndef FM_GDN_CUH
#define FM_GDN_CUH

#define FM_GDN_MAX_DK 128      /* a head's key dims held in one block */

/* The key head value head h reads: h % hk in llama.cpp's tiled order (Qwen3.5/3.6),
 * h / (hv / hk) in grouped order (Qwen3-Next): ModelConfig.key_head_of in shared/config.py. */
FM_DEVICE int fm_key_head(int h, int hk, int hv, int tiled) { return tiled ? h % hk : h / (hv / hk); }

#endif
