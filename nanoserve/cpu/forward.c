/* CpuLlama's layers in one C call: the C functions cpu/llama.py calls one by one, called from here.

   A decode step of one sequence reads every weight once (SmolLM2-135M: ~270 MB
   in bf16, ~540 MB in float32) and does almost no arithmetic per byte, so the
   memory's speed sets the floor of its time. Around that reading, cpu/llama.py
   makes eleven calls per layer from Python (ctypes, a fresh output tensor, a
   few attribute reads each: ~10 us apiece), 330 over SmolLM2's 30 layers: at
   batch 1 about a third of the step, time in which no weight is read.

   This file makes the same calls from C. It takes the addresses of the same
   functions (ops.c's, matmul.c's or matmul_bf16.c's panel_linear, attention.c's
   store and attention, each library built exactly as before), each layer's
   weights and cache (prepared once), and the step's tensors (one scratch
   buffer carved into the activations below), and runs, for every layer:

       x       = add_rms_norm(h += a, norm1)     a: the last layer's MLP output (layer 0: no add)
       qkv     = linear(x, [Wq | Wk | Wv])
       rotary(q and k, in place in qkv)
       store_kv(k, v -> this layer's caches at the step's slots)
       o       = attend(q over the caches, each row's table and length)
       attn    = linear(o, Wo)
       x       = add_rms_norm(h += attn, norm2)
       gate_up = linear(x, [Wg | Wu])
       act     = silu_mul(gate_up)
       a       = linear(act, Wd)                 left for the next layer (or the final norm) to add

   The same functions with the same arguments in the same order as
   CpuLlamaLayer.forward: the same bits (tests/test_cpu_forward.py). Each
   function keeps its own OpenMP threads. Nothing here is checked again:
   cpu/forward.py checks the layouts before the call, and store and attend
   check every slot, length and block id, as when Python calls them; the first
   status that is not 0 stops the loop and is returned (attend's as it is,
   store's minus 10). */

#include <stdint.h>

typedef void (*norm_fn)(void *h, const void *a, const void *w, void *out, int64_t rows, int64_t dim, float eps);
typedef void (*linear_fn)(const void *x, int64_t ldx, const void *packed, const float *bias, void *y, int64_t ldy,
                          int64_t m, int64_t n, int64_t k);
typedef void (*rotary_fn)(void *x, int64_t row_stride, const float *cos, const float *sin, int64_t rows,
                          int64_t heads, int64_t dim);
typedef void (*silu_fn)(const void *gate_up, void *out, int64_t rows, int64_t inter);
typedef int (*store_fn)(const void *k, const void *v, int64_t k_stride, int64_t v_stride, void *k_cache,
                        void *v_cache, const int64_t *slots, int64_t rows, int64_t row, int64_t num_slots);
typedef int (*attend_fn)(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                         const int64_t *lens, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                         int64_t max_blocks, int64_t N, int64_t q_stride, float scale, int64_t window);

struct kernels {            /* the functions, from the libraries cpu/llama.py calls (built for the model's dtype) */
    norm_fn add_rms_norm;
    rotary_fn rotary;
    silu_fn silu_mul;
    linear_fn linear;
    store_fn store;
    attend_fn attend;
};

struct dims {               /* the model's sizes (every layer has the same) */
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int64_t elem;           /* bytes per value: 4 (float32) or 2 (bf16) */
    int64_t block_size, num_blocks;    /* the KV pool: [num_blocks, block_size, kv_heads, head_dim] per layer */
};

struct layer {              /* one layer: its weights (packed panels, float32 biases or NULL) and its caches */
    const void *norm1, *norm2;
    float eps1, eps2;
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    void *k_cache, *v_cache;
    float scale;
    int64_t window;         /* 0: every token; W: a sliding-window layer's last W tokens */
};

struct step {               /* this forward's rows: the residual stream, the scratch, the attention's indices */
    int64_t rows;
    void *h;                                /* [rows, hidden] the residual stream, updated in place */
    void *x, *qkv, *o, *attn, *gate_up, *act, *a;   /* scratch: [rows, hidden | (Hq + 2 Hkv) D | Hq D | hidden
                                                       | 2 inter | inter | hidden] */
    const float *cos, *sin;                 /* [rows, head_dim] */
    const int64_t *slots;                   /* [rows] where each row's K/V goes */
    const int64_t *tables, *lens;           /* [rows, max_blocks], [rows]: what each row attends */
    int64_t max_blocks;
};

int forward_layers(const struct kernels *f, const struct dims *d, const struct layer *layers, int64_t num_layers,
                   const struct step *s) {
    const int64_t T = s->rows, H = d->hidden, D = d->head_dim, Hq = d->heads, Hkv = d->kv_heads, I = d->inter;
    const int64_t width = (Hq + 2 * Hkv) * D;                  /* one row of qkv */
    char *qkv = s->qkv;                                        /* k and v: columns of qkv, Hq D and (Hq + Hkv) D in */
    const char *k = qkv + Hq * D * d->elem, *v = qkv + (Hq + Hkv) * D * d->elem;
    for (int64_t l = 0; l < num_layers; l++) {
        const struct layer *L = layers + l;
        f->add_rms_norm(s->h, l == 0 ? 0 : s->a, L->norm1, s->x, T, H, L->eps1);
        f->linear(s->x, H, L->qkv, L->qkv_bias, s->qkv, width, T, width, H);
        f->rotary(s->qkv, width, s->cos, s->sin, T, Hq + Hkv, D);
        int status = f->store(k, v, width, width, L->k_cache, L->v_cache, s->slots, T, Hkv * D,
                              d->num_blocks * d->block_size);
        if (status != 0) return status - 10;
        status = f->attend(s->qkv, L->k_cache, L->v_cache, s->tables, s->lens, s->o, T, Hq, Hkv, D,
                           d->block_size, s->max_blocks, d->num_blocks, width, L->scale, L->window);
        if (status != 0) return status;
        f->linear(s->o, Hq * D, L->o, L->o_bias, s->attn, H, T, H, Hq * D);
        f->add_rms_norm(s->h, s->attn, L->norm2, s->x, T, H, L->eps2);
        f->linear(s->x, H, L->gate_up, L->gate_up_bias, s->gate_up, 2 * I, T, 2 * I, H);
        f->silu_mul(s->gate_up, s->act, T, I);
        f->linear(s->act, I, L->down, L->down_bias, s->a, H, T, H, I);
    }
    return 0;
}
