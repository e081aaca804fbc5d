/*
 * dgr_shard.h - the project-owned C ABI of one dgr shard engine.
 *
 * A shard engine owns main layers [layer_begin, layer_end) of one GGUF model and runs them in a
 * patched llama.cpp (see patches/). Between shards only the residual boundary crosses: the first
 * shard takes token ids, every other shard takes boundary rows (f32, `in_width` floats per token)
 * plus positions; the last shard produces logits (`n_vocab` floats per requested row), every other
 * shard produces boundary rows (`out_width` floats per token, one per input row).
 *
 * Sessions: a session is keyed by (session_id, epoch) and maps to one llama.cpp sequence of its
 * own (non-unified KV: `n_ctx_per_session` cells each). Opening a session with a newer epoch
 * discards the older epoch's state (cache miss); an older epoch is refused (DGR_E_STALE_EPOCH).
 * Positions must continue the session's KV exactly: row i of a forward call must carry position
 * next_pos + i. Nothing is guessed.
 *
 * Architectures: dense `llama` (boundary = the residual, n_embd floats per token) and DeepSeek V4
 * `deepseek4` (boundary = the hc_mult = 4 hyper-connection streams before the head's collapse and
 * the final norm: 4 * n_embd floats per token, stream-major [n_embd, 4] per row). V4's first
 * `hash_layer_count` layers route experts by token id, so a V4 shard that is not the first but
 * owns one of them (layer_begin < hash_layer_count) takes the token ids with its boundary rows
 * (info.needs_token_ids); its compressed (CSA/HCA), indexer, compressor and sliding-window state
 * covers its own layers only.
 *
 * MTP / nextn layers belong to the last shard (info.mtp_owner), which loads them when opened with
 * load_mtp (DeepSeek V4, one nextn block; ABI 9) and then drafts with them
 * (dgr_session_mtp_draft; the ownership contract is in docs/speculative.md). n_layer counts main
 * layers only (block_count less nextn_predict_layers).
 *
 * Conventions (llama.h / zstd style):
 *  - every function that can fail returns a dgr_status; DGR_OK is 0;
 *  - the message of the last failure on the calling thread is dgr_last_error(); for a
 *    DGR_E_STALE_EPOCH failure, the epoch the engine holds is dgr_last_held_epoch();
 *  - every status below says what happened to the session's state;
 *  - handles are opaque; dgr_engine_free(NULL) is a no-op;
 *  - an engine's calls take the engine's own lock (ABI 11), so its native links (below) and the
 *    Python binding (which also holds one lock per handle) can share it; distinct handles are
 *    independent;
 *  - the ABI grows by adding names, never by changing a signature: check dgr_abi_version().
 */
#ifndef DGR_SHARD_H
#define DGR_SHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DGR_ABI_VERSION 16

/* Magic and version at the head of a saved session state (see dgr_session_state_save). */
#define DGR_STATE_MAGIC 0x53524744u /* 'DGRS' */
#define DGR_STATE_VERSION 1

/* deepseek4: how many of the newest positions dgr_session_truncate can drop (the rejected
 * drafts of a verification pass): llama.cpp's n_rs_seq, the snapshots per session of the
 * compressor (CSA/HCA) and indexer state that let it roll that state back. */
#define DGR_V4_ROLLBACK_ROWS 16

typedef enum dgr_status {
    /* Success. */
    DGR_OK = 0,
    /* An argument is invalid (null pointer, zero rows, token id out of vocabulary, ...).
     * Nothing changed: the engine and every session are as before the call. */
    DGR_E_INVALID_ARGUMENT = 1,
    /* The GGUF could not be read or loaded (missing, truncated, corrupt). No engine was created. */
    DGR_E_MODEL_LOAD = 2,
    /* The GGUF's architecture is not covered by the range-ownership patches. No engine created. */
    DGR_E_UNSUPPORTED_ARCH = 3,
    /* The layer range is empty or outside [0, n_layer). No engine was created. */
    DGR_E_LAYER_RANGE = 4,
    /* No open session has this id (or this epoch has not been opened yet). Nothing changed. */
    DGR_E_UNKNOWN_SESSION = 5,
    /* The epoch is older than the session's current epoch. Nothing changed; the newer epoch's
     * state is untouched. */
    DGR_E_STALE_EPOCH = 6,
    /* Every session slot is taken (max_sessions). Nothing changed. */
    DGR_E_CAPACITY = 7,
    /* The positions do not continue the session's KV exactly. Nothing changed. */
    DGR_E_POSITION = 8,
    /* Wrong shape: rows missing or given where tokens are expected, wrong row width, more rows
     * than n_batch, output buffer too small. Nothing changed. */
    DGR_E_SHAPE = 9,
    /* The session's context (n_ctx_per_session) or the KV cache has no room for these rows.
     * Nothing changed: the session keeps its state and position. */
    DGR_E_CONTEXT_FULL = 10,
    /* llama_decode failed. The rows of this call were rolled back: the session keeps the state
     * and position it had before the call. Where the architecture's state cannot drop a tail
     * (DeepSeek V4 compressed/indexer state) the session is emptied instead (next position 0;
     * the message says so) and must be re-prefilled. Other sessions are untouched. */
    DGR_E_DECODE = 11,
    /* A saved state does not fit this engine (bad magic/version/range/width) - nothing changed -
     * or llama.cpp refused it, in which case the session is emptied (next position 0). */
    DGR_E_STATE = 12,
    /* The requested feature is not there: MTP asked of a shard that does not own the MTP block,
     * of a model without one, or of an engine that did not load it; or the architecture cannot
     * do it (truncating DeepSeek V4 state to a non-zero length). Nothing changed. */
    DGR_E_UNSUPPORTED = 13,
    /* An unexpected internal failure (exception). The engine's sessions are unchanged unless the
     * message says otherwise. */
    DGR_E_INTERNAL = 14,
    /* Native links (ABI 11): the stage before this one ended its link without DGR_LINK_END (its
     * process died, or it closed the session): that stage is lost. This stage's session is
     * untouched. */
    DGR_E_LINK_LOST = 15,
    /* (ABI 13) The rest are the statuses a worker or a native link refuses with besides the
     * engine's, so that every data path speaks one vocabulary (dgr_engine/status.py is the same
     * table; no status travels in a message's text). A frame is malformed: not a message, a kind
     * that is not due, rows, widths, counts or lengths that do not agree, non-finite boundary
     * values. A native link names the stage that sent it (a peer's bad frame is the peer's).
     * Nothing changed. */
    DGR_E_FRAME = 16,
    /* A sealed message whose tag does not verify, or a missing or wrong session secret or route
     * grant. Nothing changed. */
    DGR_E_UNAUTHENTICATED = 17,
    /* The engine produced NaN or infinity: the session's state on that stage is unusable. */
    DGR_E_NON_FINITE = 18,
    /* A valid grant or secret that does not permit this call. Nothing changed. */
    DGR_E_PERMISSION = 19,
    /* The frame was meant for another worker (its expectations; the next four say which). */
    DGR_E_EXPECTATION = 20,
    DGR_E_EXPECTATION_SCHEMA = 21,
    DGR_E_EXPECTATION_MODEL = 22,
    DGR_E_EXPECTATION_RANGE = 23,
    DGR_E_EXPECTATION_WIDTH = 24,
    /* A message over the size limit. Nothing changed. */
    DGR_E_MESSAGE_SIZE = 25,
    /* The frame's deadline passed before the engine ran it. Nothing changed. */
    DGR_E_DEADLINE = 26,
    /* The worker is shutting down. */
    DGR_E_SHUTTING_DOWN = 27,
    /* A stage (the next one, for a worker) could not be reached. */
    DGR_E_UNAVAILABLE = 28,
} dgr_status;

/* Stable name of a status code ("DGR_E_STALE_EPOCH"); "DGR_E_UNKNOWN_STATUS" for others. */
const char * dgr_status_name(int status);

/* Message of the last failure on the calling thread ("" if none). Valid until the next call. */
const char * dgr_last_error(void);

/* When the last failure on the calling thread was DGR_E_STALE_EPOCH: the epoch the engine holds
 * for the session that call named (newer than the refused one). -1 after any other failure or
 * after a success. Valid until the next call. (ABI 3) */
int64_t dgr_last_held_epoch(void);

/* Runtime ABI version: compare with DGR_ABI_VERSION. */
uint32_t dgr_abi_version(void);

/* The llama.cpp commit this library was built from (from the manifest), or "unknown". */
const char * dgr_llama_commit(void);

/* The base patch stack this library was built with: lowercase hex SHA-256 over the patches of
 * patches/ without a "Family:" header line, in order (each name, NUL, SHA-256 of its bytes;
 * native/build_llama.py), or "" if unknown. Family patches are hashed per architecture
 * (dgr_family_patch_sha256), so adding one leaves this value alone. (ABI 2) */
const char * dgr_patch_stack_sha256(void);

/* The family patch of an architecture this library was built with: lowercase hex SHA-256 over
 * that architecture's family patches in order (patches whose header says "Family: ARCH"; each
 * name, NUL, SHA-256 of its bytes), or "" when it has none (the base stack's architectures, an
 * uncovered one, NULL). Static text. (ABI 8) */
const char * dgr_family_patch_sha256(const char * arch);

/* The architectures this library runs, comma-separated: the base stack's (llama, deepseek4),
 * then those of the family patches built in, sorted. Static text. (ABI 8) */
const char * dgr_supported_archs(void);

/* The build options that can change results: the manifest's cmake options this library was
 * built with, as sorted "KEY=VALUE" pairs joined by ';' (cffi_build.py), or "" if unknown. (ABI 4) */
const char * dgr_build_flags(void);

/* What ggml was compiled to use on this build (llama_print_system_info: instruction sets,
 * OpenMP, backends). Static text. (ABI 4) */
const char * dgr_system_info(void);

typedef struct dgr_engine dgr_engine;

typedef struct dgr_engine_params {
    const char * model_path;      /* GGUF file */
    int32_t layer_begin;          /* first owned main layer */
    int32_t layer_end;            /* one past the last owned main layer; < 0: up to n_layer */
    uint32_t max_sessions;        /* concurrent sessions (llama.cpp sequences), 1..256 */
    uint32_t n_ctx_per_session;   /* KV cells per session */
    int32_t n_threads;            /* compute threads */
    uint32_t n_batch;             /* most rows one forward call may carry */
    uint32_t n_ubatch;            /* physical micro-batch */
    uint8_t load_mtp;             /* 1: load the MTP (nextn) block and its own context (ABI 9):
                                     deepseek4 with one nextn block, on the last shard only, and
                                     on a last shard that is not the first only if the block
                                     carries nextn.embed_tokens; else DGR_E_UNSUPPORTED, no engine.
                                     Forward calls then need token ids (info.needs_token_ids) */
    int32_t kv_type;              /* dgr_kv_type: KV cache element type (ABI 5) */
    int32_t flash_attn;           /* dgr_flash_attn: flash-attention mode (ABI 5) */
} dgr_engine_params;

/* KV cache element types (K and V alike). Zero is llama.cpp's default. (ABI 5) */
typedef enum dgr_kv_type {
    DGR_KV_F16 = 0,
    DGR_KV_F32 = 1,
    DGR_KV_Q8_0 = 2,  /* a quantized V cache needs flash attention: "off" is refused */
} dgr_kv_type;

/* Flash-attention modes. Zero is llama.cpp's default ("auto": on where the backend has it).
 * (ABI 5) */
typedef enum dgr_flash_attn {
    DGR_FLASH_ATTN_AUTO = 0,
    DGR_FLASH_ATTN_OFF = 1,
    DGR_FLASH_ATTN_ON = 2,
} dgr_flash_attn;

/* Defaults: whole model, 4 sessions, 512 cells each, 2 threads, n_batch 512, n_ubatch 512,
 * f16 KV cache, flash attention auto (llama.cpp's own defaults). */
dgr_engine_params dgr_engine_default_params(void);

/* Opens the model's owned range. On success *out holds a new engine (free with
 * dgr_engine_free); on failure *out is NULL and the status says why. */
int dgr_engine_open(const dgr_engine_params * params, dgr_engine ** out);

/* Frees the engine and every session's state. NULL is a no-op. */
void dgr_engine_free(dgr_engine * engine);

typedef struct dgr_shard_info {
    char arch[32];                /* general.architecture */
    int32_t n_layer;              /* main layers of the whole model */
    int32_t layer_begin;
    int32_t layer_end;
    int32_t n_embd;
    int32_t n_vocab;
    int32_t in_width;             /* floats per input boundary row; 0 on the first shard
                                     (n_embd; 4 * n_embd for deepseek4) */
    int32_t out_width;            /* floats per output row: boundary width, or n_vocab if last */
    uint8_t is_first;             /* takes token ids */
    uint8_t is_last;              /* produces logits */
    uint8_t needs_token_ids;      /* rows must come with token ids: the first shard, one that
                                     owns a hash-routed layer (deepseek4: layer < hash_layer_count)
                                     or one that loaded the MTP block */
    uint8_t mtp_owner;            /* owns the MTP/nextn layers (the last shard); loaded with
                                     load_mtp only */
    uint32_t max_sessions;
    uint32_t n_ctx_per_session;
    uint32_t n_batch;
} dgr_shard_info;

int dgr_engine_info(const dgr_engine * engine, dgr_shard_info * out);

typedef struct dgr_engine_stats {
    uint64_t weight_bytes;        /* model buffers held by this engine */
    uint64_t kv_bytes;            /* context (KV / memory) buffers */
    uint64_t compute_bytes;       /* compute buffers */
    uint64_t rss_bytes;           /* process resident set now */
    uint64_t peak_rss_bytes;      /* process peak resident set */
    uint32_t open_sessions;
    uint64_t rows_forwarded;
    uint64_t forward_calls;
    uint64_t forward_ns;          /* wall time spent in forward calls */
} dgr_engine_stats;

int dgr_engine_stats_get(const dgr_engine * engine, dgr_engine_stats * out);

/* Opens (session_id, epoch). If the session is open with an older epoch, that epoch's state is
 * discarded first (cache miss: the new epoch starts empty at position 0). The same epoch again:
 * DGR_OK, nothing changed. An older epoch: DGR_E_STALE_EPOCH. No free slot: DGR_E_CAPACITY. */
int dgr_session_open(dgr_engine * engine, uint64_t session_id, uint64_t epoch);

/* Closes the session and frees its state and slot. Older epoch: DGR_E_STALE_EPOCH (nothing
 * changed). Unknown session: DGR_E_UNKNOWN_SESSION. */
int dgr_session_close(dgr_engine * engine, uint64_t session_id, uint64_t epoch);

/* Runs n_rows rows through the owned layers.
 *  tokens:    n_rows token ids; required on the first shard, also required on a shard whose
 *             info.needs_token_ids is set (missing: DGR_E_SHAPE; an id outside the vocabulary:
 *             DGR_E_INVALID_ARGUMENT); otherwise may be NULL (ignored).
 *  rows:      n_rows * row_width floats (row-major); required on every shard but the first,
 *             must be NULL on the first. row_width must equal info.in_width.
 *  positions: n_rows positions, each next_pos + i.
 *  want:      on the last shard, which rows produce logits (NULL: the last row only); ignored
 *             elsewhere (every row produces a boundary row).
 *  out:       receives n_out * info.out_width floats; out_capacity is its size in floats.
 *  n_out:     receives the number of output rows.
 * On success the session's next position advances by n_rows. On failure see the status. */
int dgr_session_forward(dgr_engine * engine, uint64_t session_id, uint64_t epoch,
                        uint32_t n_rows, const int32_t * tokens, const float * rows,
                        uint32_t row_width, const int32_t * positions, const uint8_t * want,
                        float * out, size_t out_capacity, uint32_t * n_out);

/* One session's part of a co-batched forward (dgr_forward_batch, ABI 7). The inputs are
 * dgr_session_forward's; the outputs are set by the call. */
typedef struct dgr_forward_item {
    uint64_t session_id;
    uint64_t epoch;
    uint32_t n_rows;
    const int32_t * tokens;
    const float * rows;
    uint32_t row_width;
    const int32_t * positions;
    const uint8_t * want;
    float * out;
    size_t out_capacity;
    /* out: output rows written (as dgr_session_forward's n_out) */
    uint32_t n_out;
    /* out: DGR_OK, or this item's failure (the statuses of dgr_session_forward) */
    int32_t status;
    /* out: on DGR_E_STALE_EPOCH, the epoch the engine holds for the session; else -1 */
    int64_t held_epoch;
    /* out: the failure's message ("" on success) */
    char error[256];
} dgr_forward_item;

/* Runs the rows of several sessions, each item as dgr_session_forward would. Items run in
 * sequence order; neighbours share one llama_decode (one sequence per session) while they carry
 * fewer than 32 rows together, and an item of 32 rows or more runs alone (deepseek4: every item
 * alone). Below 32 rows llama.cpp computes each row's matmuls on their own (patch 0010), so a
 * session's outputs have the same bits as when it runs alone (tested for the fixtures' tensor
 * types; CPU-repacked quantized types may differ, so co-batching is part of the lane).
 * Each item is checked first: an item that fails its checks (or names a session already in the
 * call) gets its status and message and does not run, and the other items still do. If a
 * llama_decode fails, every item of it gets the failure and each of their sessions is rolled
 * back as dgr_session_forward says. Returns DGR_OK when the items were examined (read each
 * item's status), DGR_E_SHAPE (nothing ran) when the items that passed their checks carry more
 * than n_batch rows together, DGR_E_INVALID_ARGUMENT for NULLs. */
int dgr_forward_batch(dgr_engine * engine, dgr_forward_item * items, uint32_t n_items);

/* Keeps the first n_keep positions of the session and drops the rest (n_keep <= next_pos).
 * On success the next position is n_keep; with the MTP block loaded its KV drops the same tail,
 * and a truncation to before the last forward call's first row loses the session's MTP inputs
 * (drafts refused until a new epoch). deepseek4 state (compressed CSA/HCA, indexer) can drop a
 * tail only within the session's last forward call, at most DGR_V4_ROLLBACK_ROWS positions,
 * once (llama.cpp's n_rs_seq snapshots: the next forward restores them): the rejected drafts of
 * a verification pass. Any other n_keep but 0 or next_pos gives DGR_E_UNSUPPORTED (nothing
 * changed). */
int dgr_session_truncate(dgr_engine * engine, uint64_t session_id, uint64_t epoch, int32_t n_keep);

/* Greedy drafts of the MTP block (engines opened with load_mtp; ABI 9). last_token is the token
 * at the session's next position (the one its last forward's logits gave); the block drafts
 * the k tokens after it, each the argmax of its logits (the lowest id on a tie), feeding each
 * draft back with its own output hidden state, as llama.cpp's draft-mtp does. out receives
 * *n_out = min(k, n_ctx_per_session - next_pos) token ids. Nothing changes: the session's
 * position, KV and MTP state are as before (the draft rows are dropped from the MTP KV again).
 * No MTP block on this engine, or the session's MTP inputs lost (a state load, a truncation
 * before its last forward, a draft as from an earlier position not yet truncated to):
 * DGR_E_UNSUPPORTED. last_token outside the vocabulary: DGR_E_INVALID_ARGUMENT. */
int dgr_session_mtp_draft(dgr_engine * engine, uint64_t session_id, uint64_t epoch, int32_t last_token,
                          uint32_t k, int32_t * out, uint32_t * n_out);

/* dgr_session_mtp_draft as from position n_keep (1 <= n_keep <= next_pos; ABI 10): the MTP
 * context first drops its rows from n_keep, as dgr_session_truncate would (pending_h becomes the
 * hidden state of row n_keep - 1), but the main sequence keeps every row; then last_token is the
 * token at n_keep and the k drafts follow it. So a last stage drafts for the position a
 * verification pass kept before the next frame truncates the session; that later
 * dgr_session_truncate to the same n_keep leaves the MTP state as it is. n_keep outside
 * [1, next_pos]: DGR_E_POSITION; before the first row of the last forward call the MTP block
 * holds: DGR_E_UNSUPPORTED; both with nothing changed. A forward before the session is
 * truncated to n_keep loses its MTP inputs (drafts refused until a new epoch), and so does a
 * truncation past n_keep; dgr_session_mtp_draft is refused until then. */
int dgr_session_mtp_draft_from(dgr_engine * engine, uint64_t session_id, uint64_t epoch, int32_t n_keep,
                               int32_t last_token, uint32_t k, int32_t * out, uint32_t * n_out);

/* The session's next position (the number of positions its KV holds). */
int dgr_session_next_pos(const dgr_engine * engine, uint64_t session_id, uint64_t epoch,
                         int32_t * out);

/* Size in bytes of the session's saved state (header included). */
int dgr_session_state_size(dgr_engine * engine, uint64_t session_id, uint64_t epoch, size_t * out);

/* Saves the session's state (DGR_STATE_MAGIC header, range, widths, position, llama.cpp
 * sequence state) into buf; the MTP block's state is not in it. Nothing changes. Too small a
 * buffer: DGR_E_SHAPE. */
int dgr_session_state_save(dgr_engine * engine, uint64_t session_id, uint64_t epoch,
                           uint8_t * buf, size_t capacity, size_t * written);

/* Replaces the (open) session's state by a saved one. A header that does not fit this engine:
 * DGR_E_STATE, nothing changed. llama.cpp refusing the payload: DGR_E_STATE, session emptied. */
int dgr_session_state_load(dgr_engine * engine, uint64_t session_id, uint64_t epoch,
                           const uint8_t * buf, size_t size);

/* ---- the vocabulary alone (ABI 6) --------------------------------------------------------
 * A GGUF's tokenizer without its weights (llama.cpp's vocab-only load): text to token ids and
 * back, end-of-generation tokens, the chat template. For a split model, open its first file. */

typedef struct dgr_vocab dgr_vocab;

typedef struct dgr_vocab_info {
    int32_t n_vocab;
    int32_t bos;                 /* -1: none */
    int32_t eos;                 /* -1: none */
    int32_t eot;                 /* -1: none */
    uint8_t add_bos;             /* the model wants BOS before a prompt */
    uint8_t has_chat_template;   /* tokenizer.chat_template is present */
    uint8_t has_tokenizer;       /* 0: token ids only (vocabulary type "none"): tokenize and
                                    piece answer DGR_E_UNSUPPORTED */
} dgr_vocab_info;

typedef struct dgr_chat_message {
    const char * role;
    const char * content;
} dgr_chat_message;

/* Loads the vocabulary of model_path. A file without one: DGR_E_MODEL_LOAD. */
int dgr_vocab_open(const char * model_path, dgr_vocab ** out);

/* Frees the vocabulary (NULL is a no-op). */
void dgr_vocab_free(dgr_vocab * vocab);

int dgr_vocab_get_info(const dgr_vocab * vocab, dgr_vocab_info * out);

/* Tokenizes text_len bytes of text (add_special: BOS/EOS as the model wants; parse_special:
 * control tokens written in the text are tokens). Too small a buffer: DGR_E_SHAPE and
 * *n_tokens = the count needed. */
int dgr_vocab_tokenize(const dgr_vocab * vocab, const char * text, int32_t text_len,
                       uint8_t add_special, uint8_t parse_special, int32_t * tokens,
                       int32_t capacity, int32_t * n_tokens);

/* The bytes of one token's piece (they may end inside a UTF-8 character: the next piece
 * completes it); special: render control tokens too. Too small a buffer: DGR_E_SHAPE and
 * *n_bytes = the size needed. A token outside the vocabulary: DGR_E_INVALID_ARGUMENT. */
int dgr_vocab_piece(const dgr_vocab * vocab, int32_t token, uint8_t special, char * buf,
                    int32_t capacity, int32_t * n_bytes);

/* Whether token ends a generation (EOS, EOT and the model's other end-of-generation tokens). */
int dgr_vocab_is_eog(const dgr_vocab * vocab, int32_t token, uint8_t * out);

/* The model's chat template applied to n messages (add_assistant: open the assistant's turn).
 * No template: DGR_E_UNSUPPORTED. A template llama.cpp cannot apply: DGR_E_UNSUPPORTED. Too small
 * a buffer: DGR_E_SHAPE and *n_bytes = the size needed. */
int dgr_vocab_chat(const dgr_vocab * vocab, const dgr_chat_message * messages, size_t n,
                   uint8_t add_assistant, char * buf, int32_t capacity, int32_t * n_bytes);

/* ---- Sampling (ABI 15; docs/sampling.md) ----
 *
 * dgr's one sampler: the token a session takes from one row of logits. Its randomness is a
 * fixed function of (seed, position) only (a counter-based generator), so the same logits,
 * parameters, seed, position and history give the same token on every route, data path and
 * epoch. docs/sampling.md states the algorithm step by step. */
typedef struct dgr_sampling {
    uint64_t seed;              /* the session's seed */
    double temperature;         /* >= 0 and finite; 0: greedy (the lowest id of the largest) */
    int32_t top_k;              /* >= 0: keep the top_k most likely; 0: all */
    double top_p;               /* (0, 1]: keep the most likely whose weight reaches top_p */
    double min_p;               /* [0, 1]: drop tokens under min_p of the most likely's weight */
    double presence_penalty;    /* [-2, 2], OpenAI's: subtracted once from a token seen */
    double frequency_penalty;   /* [-2, 2], OpenAI's: subtracted per time a token was seen */
    double repetition_penalty;  /* > 0, llama.cpp's: a seen token's logit divided (> 0) or
                                   multiplied (<= 0) by it; 1: none */
    int32_t penalty_last_n;     /* >= 0: the penalties look at the last this many tokens
                                   before the position; 0: no penalties */
} dgr_sampling;

/* DGR_OK, or DGR_E_INVALID_ARGUMENT (the reason in dgr_last_error) for a value out of range. */
int dgr_sampling_check(const dgr_sampling * params);

/* The token at `position` (the position it will take) from `logits` (n_vocab finite values:
 * the row of the position before it) and `history` (the tokens at the positions before it,
 * oldest first; only the last penalty_last_n are read, and only when a penalty is set).
 * DGR_E_INVALID_ARGUMENT for invalid parameters or a history token outside the vocabulary,
 * DGR_E_NON_FINITE for a logit that is NaN or infinite. */
int dgr_sample(const dgr_sampling * params, const float * logits, uint32_t n_vocab, uint32_t position,
               const int32_t * history, uint32_t n_history, int32_t * out_token);

/* The draw of (seed, position): a number in [0, 1) (docs/sampling.md, "The draw"). */
double dgr_sample_uniform(uint64_t seed, uint32_t position);

/* (ABI 16) The sampler's own exponential of min(y, 0) (docs/sampling.md, "The exponential"):
 * the same bits on every system, where the C library's exp differs in its last bit. */
double dgr_sample_exp(double y);

/* ---- Native frame links (ABI 11; docs/native-path.md) ----
 *
 * A link runs one session epoch's frames of a chained route or a ring on this engine without
 * Python: a thread of its own reads each frame from a connected socket, checks it, runs it
 * (dgr_session_forward, under the engine's lock) and writes the output to the next socket. The
 * caller (the worker's Python) owns the control: it authenticates and connects the sockets,
 * opens and closes the session, and hands the link the connected descriptors, which the link
 * then owns (it closes them when it ends).
 *
 * Every message on a link is a 56-byte little-endian header and a payload:
 *   u32 magic (DGR_LINK_MAGIC), u16 version (DGR_LINK_VERSION), u16 kind (dgr_link_kind),
 *   u64 epoch, u32 step, i32 pos (the first row's position), u32 n_rows, u32 width (floats
 *   per row: 0 on the first stage's input, in_width elsewhere), u32 until_step (a ring's last
 *   step), u32 n_stop (ring stop tokens, <= DGR_LINK_MAX_STOP), u32 hop (the stage the message
 *   comes from or, for DGR_LINK_FAILED, the stage that failed), i32 value (DGR_LINK_TOKEN: the
 *   session's token (ABI 15: its sampler's); DGR_LINK_FAILED: the status; DGR_LINK_ROWS: the rows' kind, 0 unspecified, 1
 *   prefill, 2 decode, 3 replay, as ForwardRequest.kind), u32 payload_bytes, u32 engine_us (the engine
 *   time of the frame's pass so far, summed over the stages it went through: each stage adds
 *   its own; the TOKEN of a pass carries the whole pass's).
 * DGR_LINK_ROWS payload: n_stop i32 stop tokens, n_rows i32 token ids, n_rows * width f32 rows,
 * then the pass's trace: one u32 per stage the frame went through (each its engine microseconds;
 * none into the first stage, `hop` into stage `hop`); payload_bytes must be exactly that.
 * DGR_LINK_TOKEN (last stage to the client): the whole pass's trace, one u32 per stage.
 * DGR_LINK_FAILED: the failure's message (UTF-8, at most 255 bytes).
 *
 * A stage checks each DGR_LINK_ROWS frame before the engine sees it (magic, version, kind,
 * epoch: older is DGR_E_STALE_EPOCH, any other DGR_E_UNKNOWN_SESSION; n_rows in 1..max_rows,
 * width, n_stop, payload_bytes, every row finite: DGR_E_FRAME, naming the stage that sent the
 * frame - the stage before, on the link from it, or a ring's last stage on the first stage's
 * ring input (ring_in_hop, ABI 14) - not this one (ABI 13)); the
 * engine checks positions and token ids. The last stage answers each frame with the token its
 * session's sampler (params.sampling, dgr_sample) takes from its last row at the next position
 * (DGR_LINK_TOKEN to the client; greedy: the lowest index of the largest logit) and, on a ring, sends the first stage the next step's frame (that token at the next
 * position) unless the step was until_step or the token is a stop token. A frame that fails its
 * checks or its run ends the link: it sends DGR_LINK_FAILED (its hop, status and message) on to
 * the next stage, which passes it on as it is and ends too, up to the client. The engine's
 * calls are serialised by its own lock, so links and the Python binding share one engine. A peer that
 * closes its socket ends the link (DGR_LINK_STATE_ENDED); so does dgr_link_free. */
/* 0x4B4E4C44: "DLNK" in little-endian bytes */
#define DGR_LINK_MAGIC 1263422532
#define DGR_LINK_VERSION 1
#define DGR_LINK_HEADER_BYTES 56
#define DGR_LINK_MAX_STOP 16
#define DGR_LINK_MESSAGE_BYTES 256

typedef enum dgr_link_kind {
    DGR_LINK_ROWS = 1,   /* rows to run (token ids and, past the first stage, boundary rows) */
    DGR_LINK_TOKEN = 2,  /* the last stage's token for a frame, to the client */
    DGR_LINK_FAILED = 3, /* a stage failed: status and message, on to the client */
    DGR_LINK_HELLO = 4,  /* a connection's introduction and its answer: the control shell's
                            (the worker's Python), before a link owns the socket; a link
                            refuses it like any other kind but rows */
    DGR_LINK_END = 5,    /* the sender ends cleanly: each stage passes it on and ends; a link
                            whose input ends without it reports the stage before it lost
                            (DGR_E_LINK_LOST; on the first stage, the client left) */
} dgr_link_kind;

typedef enum dgr_link_state {
    DGR_LINK_STATE_RUNNING = 1,
    DGR_LINK_STATE_ENDED = 2,  /* a peer closed its socket, or dgr_link_free */
    DGR_LINK_STATE_FAILED = 3, /* a frame failed here or at a stage before it (status, error) */
} dgr_link_state;

typedef struct dgr_link dgr_link;

/* (ABI 12) A co-batching group: the links of one engine that share it run the frames that wait
 * for the engine together in one dgr_forward_batch call (at most one frame per session, the
 * first come always, the rest as they fit max_rows rows: the worker's co-batching, whose rows
 * keep each session's bits alone). A call gathers its frames while it holds the engine, so the
 * frames that come while the engine is busy, with a link's frame or a binding call, run together
 * next. Freed after every link that uses it. */
typedef struct dgr_link_batch dgr_link_batch;

int dgr_link_batch_new(dgr_engine * engine, uint32_t max_rows, dgr_link_batch ** out);
/* Engine calls made and frames run by the group so far. */
int dgr_link_batch_get_stats(dgr_link_batch * batch, uint64_t * calls, uint64_t * frames);
void dgr_link_batch_free(dgr_link_batch * batch);

typedef struct dgr_link_params {
    uint64_t session_id;
    uint64_t epoch;
    uint32_t hop;          /* this stage's index in the route (0: the first) */
    uint32_t max_rows;     /* the largest frame in rows (<= the engine's n_batch) */
    int32_t in_fd;         /* frames from the stage before (from the client on the first) */
    int32_t ring_in_fd;    /* a ring's first stage: frames from its last stage; -1: none */
    uint32_t ring_in_hop;  /* (ABI 14) a ring's first stage: the index of the stage its ring
                              frames come from (the last), named as the sender of a malformed
                              one */
    int32_t out_fd;        /* the next stage; on the last stage, the client's token stream */
    int32_t ring_out_fd;   /* a ring's last stage: the first stage; -1: none */
    int32_t notify_fd;     /* written one byte when the link ends (-1: none); not owned */
    uint32_t body_timeout_ms; /* longest wait for the rest of a frame once its header came */
    /* (ABI 12) the session's frame budget, the worker's per-client limit: at most
     * frames_per_second frames a second after a burst of `burst` (a token bucket); a frame over
     * it waits in the link for its turn (its sender is held back by TCP) rather than being
     * refused: a ring's frames come from the ring itself, with nobody to retry them. 0: none. */
    double frames_per_second;
    uint32_t burst;
    dgr_link_batch * batch; /* (ABI 12) the co-batching group the link's frames run in; NULL:
                               each frame alone (dgr_session_forward) */
    dgr_sampling sampling;  /* (ABI 15) the last stage: how it takes each frame's token
                               (dgr_sample; greedy: temperature 0, top_p 1, repetition 1) */
} dgr_link_params;

typedef struct dgr_link_stats {
    int32_t state;          /* dgr_link_state */
    int32_t status;         /* DGR_OK, or the failure's status */
    uint32_t failed_hop;    /* the stage that failed (DGR_LINK_STATE_FAILED) */
    uint64_t frames;        /* frames run here */
    uint64_t rows;          /* their rows */
    uint64_t bytes_in;      /* bytes of the frames run here, headers included */
    uint64_t bytes_out;     /* bytes sent on (frames, tokens, ring frames) */
    uint64_t engine_ns;     /* wall time of their engine calls (lock wait included) */
    uint64_t busy_ns;       /* wall time from each frame's header to its output's send to the
                               route's next step (the next stage, or a ring's first): the
                               checks, the engine, the copies; not the send itself */
    uint64_t last_frame_ns; /* CLOCK_MONOTONIC of the last frame's end (0: none yet) */
    uint64_t kind_frames[4]; /* frames run, by row kind (the ROWS header's value: 0 unspecified,
                                1 prefill, 2 decode, 3 replay; a ring's own frames are decode) */
    uint64_t kind_rows[4];   /* their rows, by row kind */
    uint64_t tokens;        /* tokens answered (the last stage) */
    uint64_t ring_frames;   /* frames sent back to the first stage (a ring's last stage) */
    uint64_t throttled;     /* (ABI 12) frames that waited for the session's frame budget */
    uint64_t throttled_ns;  /* how long they waited, in all */
    uint64_t co_batched;    /* (ABI 12) frames that shared their engine call with another
                               session's (params.batch; their engine_ns is their rows' share) */
    char error[DGR_LINK_MESSAGE_BYTES];
} dgr_link_stats;

/* Starts a link on the engine (which must outlive it): on success it owns the descriptors
 * in_fd, ring_in_fd, out_fd and ring_out_fd. DGR_E_INVALID_ARGUMENT for a missing descriptor or
 * NULL; DGR_E_UNKNOWN_SESSION / DGR_E_STALE_EPOCH unless (session_id, epoch) is open; then
 * nothing is owned. */
int dgr_link_start(dgr_engine * engine, const dgr_link_params * params, dgr_link ** out);

/* The link's state and counters now. */
int dgr_link_get_stats(dgr_link * link, dgr_link_stats * out);

/* Ends the link (its sockets shut down) and waits for its thread: its stats are final then
 * (a failure it was passing on has gone out first). Idempotent; NULL is a no-op. */
void dgr_link_stop(dgr_link * link);

/* dgr_link_stop, then closes its descriptors and frees it. NULL is a no-op. */
void dgr_link_free(dgr_link * link);

/* Sealed links (ABI 12): every message after the connections' introductions is sealed with
 * ChaCha20-Poly1305 (RFC 8439, Monocypher 4.0.3): the header stays in the clear and is the
 * associated data, the payload is encrypted in place and a 16-byte tag follows it (payload_bytes
 * counts the payload only). Each direction of each connection has its own 32-byte key (the
 * caller derives them from the session secret and the introductions' nonces: docs/native-path.md)
 * and counts its messages from 0: the nonce is the message's number (u64 little-endian, then 4
 * zero bytes), so a message replayed, dropped, reordered or moved to another connection fails
 * its tag. A sealed link takes a header only once its payload's tag verifies (the header's
 * length is bounded first: at most the largest frame this stage takes); a tag that does not
 * verify ends the link like any refused frame, with DGR_E_UNAUTHENTICATED (ABI 13; before, its
 * message's text said so under DGR_E_INVALID_ARGUMENT). */
#define DGR_LINK_KEY_BYTES 32
#define DGR_LINK_TAG_BYTES 16

typedef struct dgr_link_keys {
    uint8_t in[DGR_LINK_KEY_BYTES];       /* in_fd's messages */
    uint8_t ring_in[DGR_LINK_KEY_BYTES];  /* ring_in_fd's (unused without one) */
    uint8_t out[DGR_LINK_KEY_BYTES];      /* out_fd's */
    uint8_t ring_out[DGR_LINK_KEY_BYTES]; /* ring_out_fd's (unused without one) */
} dgr_link_keys;

/* dgr_link_start with every message sealed with keys (copied; the caller may wipe its own). */
int dgr_link_start_sealed(dgr_engine * engine, const dgr_link_params * params, const dgr_link_keys * keys,
                          dgr_link ** out);

/* Seals size bytes of text in place (the message numbered counter on its direction, keyed by
 * key, the header ad authenticated with it) and writes its tag (DGR_LINK_TAG_BYTES). */
int dgr_link_seal(const uint8_t * key, uint64_t counter, const uint8_t * ad, size_t ad_size, uint8_t * text,
                  size_t size, uint8_t * tag);

/* Opens what dgr_link_seal sealed, in place: DGR_OK, or DGR_E_UNAUTHENTICATED (ABI 13; text
 * untouched) when the tag does not verify. */
int dgr_link_unseal(const uint8_t * key, uint64_t counter, const uint8_t * ad, size_t ad_size, uint8_t * text,
                    size_t size, const uint8_t * tag);

#ifdef __cplusplus
}
#endif

#endif /* DGR_SHARD_H */
