// dgr_shard.cpp - the dgr shard engine over the patched libllama (see native/include/dgr_shard.h).
//
// One engine = one llama_model loaded for a layer range + one llama_context whose sequences are
// the sessions' slots. Every entry point validates before it touches llama.cpp, so that bad input
// never reaches an abort inside ggml, and maps each failure to a status and a message.

#include "dgr_shard.h"
#include "dgr_sampler.h"

#include "gguf.h"
#include "llama.h"
#include "llama-ext.h"

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#ifndef DGR_LLAMA_COMMIT
#define DGR_LLAMA_COMMIT "unknown"
#endif
#ifndef DGR_PATCH_STACK_SHA256
#define DGR_PATCH_STACK_SHA256 ""
#endif
// the family patches built in (cffi_build.py): "ARCH=HEX;..." sorted by architecture, HEX the
// SHA-256 over that family's patches (native/build_llama.py family_patch_sha256)
#ifndef DGR_FAMILY_PATCHES
#define DGR_FAMILY_PATCHES ""
#endif

namespace {

thread_local std::string g_last_error;
thread_local int64_t g_last_held_epoch = -1;  // >= 0 only after a DGR_E_STALE_EPOCH failure

int vfail(int status, const char * fmt, va_list args) {
    char buf[1024];
    std::vsnprintf(buf, sizeof(buf), fmt, args);
    g_last_error = buf;
    g_last_held_epoch = -1;
    return status;
}

int fail(int status, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vfail(status, fmt, args);
    va_end(args);
    return status;
}

// A DGR_E_STALE_EPOCH failure: also records the epoch the engine holds (dgr_last_held_epoch).
int fail_stale(uint64_t held_epoch, const char * fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vfail(DGR_E_STALE_EPOCH, fmt, args);
    va_end(args);
    g_last_held_epoch = static_cast<int64_t>(held_epoch);
    return DGR_E_STALE_EPOCH;
}

int ok() {
    g_last_error.clear();
    g_last_held_epoch = -1;
    return DGR_OK;
}

// llama.cpp logs: the error lines since the last clear are kept, joined by "; " (they explain a
// failed call: a failed load logs why first, e.g. the metadata key the architecture needs, and
// only then that it failed), up to k_llama_log_error_max bytes; everything is printed to stderr
// only when DGR_LLAMA_LOG is set.
thread_local std::string g_llama_last_log_error;
constexpr size_t k_llama_log_error_max = 2048;

void llama_log_sink(enum ggml_log_level level, const char * text, void * /*user*/) {
    static const bool verbose = std::getenv("DGR_LLAMA_LOG") != nullptr;
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::string line = text;
        while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
            line.pop_back();
        }
        std::string & kept = g_llama_last_log_error;
        if (!line.empty() && kept.size() < k_llama_log_error_max) {
            kept += kept.empty() ? "" : "; ";
            kept += line.substr(0, k_llama_log_error_max - kept.size());
        }
    }
    if (verbose) {
        std::fputs(text, stderr);
    }
}

void init_backend_once() {
    static std::once_flag once;
    std::call_once(once, [] {
        llama_log_set(llama_log_sink, nullptr);
        llama_backend_init();
    });
}

// architectures whose graph builders the base stack covers (patches 0005, 0007)
const char * const k_base_archs[] = {"llama", "deepseek4"};

// the family patches built in, parsed once from DGR_FAMILY_PATCHES: architecture -> hex SHA-256
const std::vector<std::pair<std::string, std::string>> & family_patches() {
    static const std::vector<std::pair<std::string, std::string>> families = [] {
        std::vector<std::pair<std::string, std::string>> out;
        const std::string text = DGR_FAMILY_PATCHES;
        size_t begin = 0;
        while (begin < text.size()) {
            size_t end = text.find(';', begin);
            if (end == std::string::npos) {
                end = text.size();
            }
            const std::string item = text.substr(begin, end - begin);
            const size_t eq = item.find('=');
            if (eq != std::string::npos && eq > 0) {
                out.emplace_back(item.substr(0, eq), item.substr(eq + 1));
            }
            begin = end + 1;
        }
        return out;
    }();
    return families;
}

// architectures whose graph builders carry the range-ownership hooks: the base stack's and
// those of the family patches built in
bool arch_supported(const std::string & arch) {
    for (const char * base : k_base_archs) {
        if (arch == base) {
            return true;
        }
    }
    for (const auto & family : family_patches()) {
        if (family.first == arch) {
            return true;
        }
    }
    return false;
}

// "llama, deepseek4, gemma3, ...": the base stack's architectures, then the families'
const std::string & supported_archs() {
    static const std::string text = [] {
        std::string out;
        for (const char * base : k_base_archs) {
            out += out.empty() ? "" : ", ";
            out += base;
        }
        for (const auto & family : family_patches()) {
            out += ", " + family.first;
        }
        return out;
    }();
    return text;
}

uint64_t read_proc_status_kb(const char * key) {
    std::ifstream f("/proc/self/status");
    std::string line;
    const size_t n = std::strlen(key);
    while (std::getline(f, line)) {
        if (line.compare(0, n, key) == 0) {
            return std::strtoull(line.c_str() + n + 1, nullptr, 10);
        }
    }
    return 0;
}

// The MTP block's per-session inputs kept outside its KV (engines with load_mtp only; see the
// ownership contract in docs/speculative.md). Invariant while `ok`: the MTP context's KV of the
// session holds exactly positions [0, next_pos), and `pending_h` is the target's hidden state
// (the hc streams) of position next_pos - 1 (zeros at next_pos 0).
struct mtp_slot {
    bool ok = true;                // false: the inputs are lost (state load, deep truncation)
    std::vector<float> pending_h;  // h of the last forwarded position
    int32_t rows_begin = 0;        // first position of the last forward call
    std::vector<float> before_h;   // pending_h as it was before that call
    std::vector<float> rows_h;     // h of that call's rows (at most k_mtp_kept_rows)
};

// The end of the MTP context's KV of the session while `ok`: next_pos, except after a draft as
// from an earlier position (dgr_session_mtp_draft_from) until the session is truncated to it.
inline int32_t mtp_end(const mtp_slot & m) {
    const size_t width = m.pending_h.size();
    return m.rows_begin + (int32_t) (width == 0 ? 0 : m.rows_h.size() / width);
}

struct session_slot {
    uint64_t epoch = 0;
    llama_seq_id seq = -1;
    int32_t next_pos = 0;
    // rows of the session's last forward call, while its deepseek4 snapshots can still roll them
    // back (dgr_session_truncate); 0 once anything else touched the session
    int32_t rollback_rows = 0;
    mtp_slot mtp;
};

struct gguf_meta {
    std::string arch;
    int64_t n_layer = -1;          // main layers: block_count less the nextn (MTP) layers
    int64_t n_layer_nextn = 0;     // {arch}.nextn_predict_layers (MTP; never loaded)
    int64_t hash_layer_count = 0;  // {arch}.hash_layer_count (V4: layers routed by token id)
    bool has_nextn_embed = false;  // blk.{n_layer}.nextn.embed_tokens is in the (first) file
};

// an unsigned integer key of the GGUF, or `def` when absent or of another type
int64_t gguf_get_u32_or(const gguf_context * g, const std::string & key, int64_t def) {
    const int64_t k = gguf_find_key(g, key.c_str());
    if (k < 0) {
        return def;
    }
    switch (gguf_get_kv_type(g, k)) {
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, k);
        case GGUF_TYPE_INT32: return gguf_get_val_i32(g, k);
        default: return def;
    }
}

int read_gguf_meta(const char * path, gguf_meta & meta) {
    gguf_init_params gp = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(path, gp);
    if (g == nullptr) {
        return fail(DGR_E_MODEL_LOAD, "cannot read GGUF '%s': missing, truncated or corrupt header", path);
    }
    const int64_t k_arch = gguf_find_key(g, "general.architecture");
    if (k_arch < 0 || gguf_get_kv_type(g, k_arch) != GGUF_TYPE_STRING) {
        gguf_free(g);
        return fail(DGR_E_MODEL_LOAD, "GGUF '%s' has no general.architecture", path);
    }
    meta.arch = gguf_get_val_str(g, k_arch);
    const std::string key = meta.arch + ".block_count";
    const int64_t k_blocks = gguf_find_key(g, key.c_str());
    if (k_blocks >= 0 && gguf_get_kv_type(g, k_blocks) == GGUF_TYPE_UINT32) {
        meta.n_layer = gguf_get_val_u32(g, k_blocks);
    }
    meta.n_layer_nextn = gguf_get_u32_or(g, meta.arch + ".nextn_predict_layers", 0);
    meta.hash_layer_count = gguf_get_u32_or(g, meta.arch + ".hash_layer_count", 0);
    if (meta.n_layer > 0 && meta.n_layer_nextn > 0) {
        meta.n_layer -= meta.n_layer_nextn;  // MTP layers are not main layers
        const std::string embed = "blk." + std::to_string(meta.n_layer) + ".nextn.embed_tokens.weight";
        meta.has_nextn_embed = gguf_find_tensor(g, embed.c_str()) >= 0;
    }
    gguf_free(g);
    return DGR_OK;
}

}  // namespace

using engine_lock = std::lock_guard<std::recursive_mutex>;

// The calling thread's last failure, for dgr_link.cpp's own refusals (dgr_last_error reads it).
int dgr_fail_with(int status, const char * message) {
    return fail(status, "%s", message);
}

struct dgr_engine {
    dgr_engine_params params{};
    std::string model_path;
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    llama_context * mtp_ctx = nullptr;  // the MTP block's context (load_mtp), its own KV
    dgr_shard_info info{};
    bool main_needs_tokens = false;     // the owned layers take token ids (first or hash-routed)
    std::unordered_map<uint64_t, session_slot> sessions;
    std::vector<llama_seq_id> free_seqs;
    int32_t hash_layer_count = 0;  // layers [0, hash_layer_count) route experts by token id
    uint64_t rows_forwarded = 0;
    uint64_t forward_calls = 0;
    uint64_t forward_ns = 0;
    // every call on the engine holds it: native links (dgr_link.cpp) run frames on their own
    // threads beside the binding's calls (recursive: a call may make another)
    mutable std::recursive_mutex call_mutex;

    ~dgr_engine() {
        if (mtp_ctx) {
            llama_free(mtp_ctx);
        }
        if (ctx) {
            llama_free(ctx);
        }
        if (model) {
            llama_model_free(model);
        }
    }

    llama_memory_t mem() const { return llama_get_memory(ctx); }

    // Empties a session's state in both contexts (a new epoch, a close, an open).
    void clear_seq(session_slot & slot) {
        llama_memory_seq_rm(mem(), slot.seq, -1, -1);
        if (mtp_ctx) {
            llama_memory_seq_rm(llama_get_memory(mtp_ctx), slot.seq, -1, -1);
            slot.mtp = mtp_slot{};
            slot.mtp.pending_h.assign((size_t) llama_model_n_embd_out(model), 0.0f);
        }
    }

    // Undoes the rows a failed forward added past slot.next_pos. State that cannot drop a tail
    // (DeepSeek V4 compressed/indexer state) is emptied instead. Says which happened.
    // The MTP context (if any) drops the same rows; its pending_h changes only on success.
    const char * roll_back(session_slot & slot) {
        slot.rollback_rows = 0;
        // deepseek4 with rows past next_pos: a bounded rollback would restore snapshots the
        // failed call may have half written; empty the session instead
        const bool v4_rows = std::strcmp(info.arch, "deepseek4") == 0 &&
                             llama_memory_seq_pos_max(mem(), slot.seq) >= slot.next_pos;
        if (!v4_rows && llama_memory_seq_rm(mem(), slot.seq, slot.next_pos, -1) &&
            (mtp_ctx == nullptr || llama_memory_seq_rm(llama_get_memory(mtp_ctx), slot.seq, slot.next_pos, -1))) {
            return "the call's rows were rolled back";
        }
        clear_seq(slot);
        slot.next_pos = 0;
        return "the session was emptied (next position 0): re-prefill it";
    }

    // The MTP side of a truncation to n_keep positions: its KV drops the same tail, and
    // pending_h becomes the kept last row's hidden state if the last call's rows still hold it;
    // otherwise the session's MTP inputs are lost (ok = false) until a new epoch.
    void mtp_truncate(session_slot & slot, int32_t n_keep) {
        mtp_slot & m = slot.mtp;
        const size_t width = m.pending_h.size();
        if (n_keep == 0) {
            clear_seq(slot);
            return;
        }
        const bool dropped = llama_memory_seq_rm(llama_get_memory(mtp_ctx), slot.seq, n_keep, -1);
        const int32_t n_rows = (int32_t) (width == 0 ? 0 : m.rows_h.size() / width);
        if (!dropped || !m.ok || n_keep < m.rows_begin || n_keep > m.rows_begin + n_rows) {
            llama_memory_seq_rm(llama_get_memory(mtp_ctx), slot.seq, -1, -1);
            m.ok = false;
            return;
        }
        const float * h = n_keep == m.rows_begin ? m.before_h.data()
                                                 : m.rows_h.data() + (size_t) (n_keep - m.rows_begin - 1) * width;
        std::memmove(m.pending_h.data(), h, width * sizeof(float));
        m.rows_h.resize((size_t) (n_keep - m.rows_begin) * width);
    }

    // Finds (session_id, epoch) for an operation on an open epoch.
    int find(uint64_t session_id, uint64_t epoch, session_slot ** out) {
        auto it = sessions.find(session_id);
        if (it == sessions.end()) {
            return fail(DGR_E_UNKNOWN_SESSION, "unknown session %llu", (unsigned long long) session_id);
        }
        if (epoch < it->second.epoch) {
            return fail_stale(it->second.epoch, "session %llu: epoch %llu is stale (current epoch %llu)",
                              (unsigned long long) session_id, (unsigned long long) epoch,
                              (unsigned long long) it->second.epoch);
        }
        if (epoch > it->second.epoch) {
            return fail(DGR_E_UNKNOWN_SESSION, "session %llu: epoch %llu is not open (current epoch %llu)",
                        (unsigned long long) session_id, (unsigned long long) epoch,
                        (unsigned long long) it->second.epoch);
        }
        *out = &it->second;
        return DGR_OK;
    }
};

// dgr_link.cpp's co-batching: a call's frames are gathered while it holds the engine, so the
// frames that come while the engine is busy (with anything) run together next.
std::recursive_mutex & dgr_engine_call_mutex(dgr_engine * engine) {
    return engine->call_mutex;
}

#define DGR_GUARD_BEGIN try {
#define DGR_GUARD_END                                                              \
    }                                                                              \
    catch (const std::exception & e) {                                             \
        return fail(DGR_E_INTERNAL, "internal error: %s", e.what());               \
    }                                                                              \
    catch (...) {                                                                  \
        return fail(DGR_E_INTERNAL, "internal error: unknown exception");          \
    }

extern "C" {

const char * dgr_status_name(int status) {
    switch (status) {
        case DGR_OK: return "DGR_OK";
        case DGR_E_INVALID_ARGUMENT: return "DGR_E_INVALID_ARGUMENT";
        case DGR_E_MODEL_LOAD: return "DGR_E_MODEL_LOAD";
        case DGR_E_UNSUPPORTED_ARCH: return "DGR_E_UNSUPPORTED_ARCH";
        case DGR_E_LAYER_RANGE: return "DGR_E_LAYER_RANGE";
        case DGR_E_UNKNOWN_SESSION: return "DGR_E_UNKNOWN_SESSION";
        case DGR_E_STALE_EPOCH: return "DGR_E_STALE_EPOCH";
        case DGR_E_CAPACITY: return "DGR_E_CAPACITY";
        case DGR_E_POSITION: return "DGR_E_POSITION";
        case DGR_E_SHAPE: return "DGR_E_SHAPE";
        case DGR_E_CONTEXT_FULL: return "DGR_E_CONTEXT_FULL";
        case DGR_E_DECODE: return "DGR_E_DECODE";
        case DGR_E_STATE: return "DGR_E_STATE";
        case DGR_E_UNSUPPORTED: return "DGR_E_UNSUPPORTED";
        case DGR_E_INTERNAL: return "DGR_E_INTERNAL";
        case DGR_E_LINK_LOST: return "DGR_E_LINK_LOST";
        case DGR_E_FRAME: return "DGR_E_FRAME";
        case DGR_E_UNAUTHENTICATED: return "DGR_E_UNAUTHENTICATED";
        case DGR_E_NON_FINITE: return "DGR_E_NON_FINITE";
        case DGR_E_PERMISSION: return "DGR_E_PERMISSION";
        case DGR_E_EXPECTATION: return "DGR_E_EXPECTATION";
        case DGR_E_EXPECTATION_SCHEMA: return "DGR_E_EXPECTATION_SCHEMA";
        case DGR_E_EXPECTATION_MODEL: return "DGR_E_EXPECTATION_MODEL";
        case DGR_E_EXPECTATION_RANGE: return "DGR_E_EXPECTATION_RANGE";
        case DGR_E_EXPECTATION_WIDTH: return "DGR_E_EXPECTATION_WIDTH";
        case DGR_E_MESSAGE_SIZE: return "DGR_E_MESSAGE_SIZE";
        case DGR_E_DEADLINE: return "DGR_E_DEADLINE";
        case DGR_E_SHUTTING_DOWN: return "DGR_E_SHUTTING_DOWN";
        case DGR_E_UNAVAILABLE: return "DGR_E_UNAVAILABLE";
        default: return "DGR_E_UNKNOWN_STATUS";
    }
}

const char * dgr_last_error(void) { return g_last_error.c_str(); }

int64_t dgr_last_held_epoch(void) { return g_last_held_epoch; }

uint32_t dgr_abi_version(void) { return DGR_ABI_VERSION; }

int dgr_sampling_check(const dgr_sampling * params) {
    char why[256];
    const int rc = dgr_sampling_valid(params, why, sizeof why);
    return rc == DGR_OK ? DGR_OK : fail(rc, "%s", why);
}

int dgr_sample(const dgr_sampling * params, const float * logits, uint32_t n_vocab, uint32_t position,
               const int32_t * history, uint32_t n_history, int32_t * out_token) {
    char why[256];
    const int rc = dgr_sample_row(params, logits, n_vocab, position, history, n_history, out_token, why, sizeof why);
    return rc == DGR_OK ? DGR_OK : fail(rc, "%s", why);
}

const char * dgr_llama_commit(void) { return DGR_LLAMA_COMMIT; }

const char * dgr_patch_stack_sha256(void) { return DGR_PATCH_STACK_SHA256; }

const char * dgr_family_patch_sha256(const char * arch) {
    if (arch == nullptr) {
        return "";
    }
    for (const auto & family : family_patches()) {
        if (family.first == arch) {
            return family.second.c_str();
        }
    }
    return "";
}

const char * dgr_supported_archs(void) { return supported_archs().c_str(); }

#ifndef DGR_BUILD_FLAGS
#define DGR_BUILD_FLAGS ""
#endif

const char * dgr_build_flags(void) { return DGR_BUILD_FLAGS; }

const char * dgr_system_info(void) { return llama_print_system_info(); }

dgr_engine_params dgr_engine_default_params(void) {
    dgr_engine_params p{};
    p.model_path = nullptr;
    p.layer_begin = 0;
    p.layer_end = -1;
    p.max_sessions = 4;
    p.n_ctx_per_session = 512;
    p.n_threads = 2;
    p.n_batch = 512;
    p.n_ubatch = 512;
    p.load_mtp = 0;
    p.kv_type = DGR_KV_F16;
    p.flash_attn = DGR_FLASH_ATTN_AUTO;
    return p;
}

int dgr_engine_open(const dgr_engine_params * params, dgr_engine ** out) {
    if (out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "out must not be NULL");
    }
    *out = nullptr;
    if (params == nullptr || params->model_path == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "params and params->model_path must not be NULL");
    }
    if (params->max_sessions < 1 || params->max_sessions > 256) {
        return fail(DGR_E_INVALID_ARGUMENT, "max_sessions must be in 1..256, got %u", params->max_sessions);
    }
    if (params->n_ctx_per_session < 1 || params->n_batch < 1 || params->n_ubatch < 1 || params->n_threads < 1) {
        return fail(DGR_E_INVALID_ARGUMENT, "n_ctx_per_session, n_batch, n_ubatch and n_threads must be positive");
    }
    if ((uint64_t) params->max_sessions * params->n_ctx_per_session > (uint64_t) INT32_MAX) {
        return fail(DGR_E_INVALID_ARGUMENT, "max_sessions x n_ctx_per_session = %llu KV cells is more than %d",
                    (unsigned long long) params->max_sessions * params->n_ctx_per_session, INT32_MAX);
    }
    ggml_type kv_type = GGML_TYPE_F16;
    switch (params->kv_type) {
        case DGR_KV_F16: kv_type = GGML_TYPE_F16; break;
        case DGR_KV_F32: kv_type = GGML_TYPE_F32; break;
        case DGR_KV_Q8_0: kv_type = GGML_TYPE_Q8_0; break;
        default: return fail(DGR_E_INVALID_ARGUMENT, "kv_type %d is not a dgr_kv_type (f16 0, f32 1, q8_0 2)", params->kv_type);
    }
    llama_flash_attn_type flash_attn = LLAMA_FLASH_ATTN_TYPE_AUTO;
    switch (params->flash_attn) {
        case DGR_FLASH_ATTN_AUTO: flash_attn = LLAMA_FLASH_ATTN_TYPE_AUTO; break;
        case DGR_FLASH_ATTN_OFF: flash_attn = LLAMA_FLASH_ATTN_TYPE_DISABLED; break;
        case DGR_FLASH_ATTN_ON: flash_attn = LLAMA_FLASH_ATTN_TYPE_ENABLED; break;
        default: return fail(DGR_E_INVALID_ARGUMENT, "flash_attn %d is not a dgr_flash_attn (auto 0, off 1, on 2)", params->flash_attn);
    }
    if (params->kv_type == DGR_KV_Q8_0 && params->flash_attn == DGR_FLASH_ATTN_OFF) {
        return fail(DGR_E_INVALID_ARGUMENT, "a q8_0 KV cache needs flash attention (llama.cpp quantizes V only with it): "
                    "use flash_attn on or auto");
    }
    DGR_GUARD_BEGIN
    init_backend_once();

    gguf_meta meta;
    if (int rc = read_gguf_meta(params->model_path, meta); rc != DGR_OK) {
        return rc;
    }
    if (!arch_supported(meta.arch)) {
        return fail(DGR_E_UNSUPPORTED_ARCH, "architecture '%s' is not covered by the range-ownership patches (supported: %s)",
                    meta.arch.c_str(), supported_archs().c_str());
    }
    if (meta.n_layer <= 0) {
        return fail(DGR_E_MODEL_LOAD, "GGUF '%s' has no valid %s.block_count", params->model_path, meta.arch.c_str());
    }
    const int32_t l_begin = params->layer_begin;
    const int32_t l_end = params->layer_end < 0 ? (int32_t) meta.n_layer : params->layer_end;
    if (l_begin < 0 || l_end > meta.n_layer || l_begin >= l_end) {
        return fail(DGR_E_LAYER_RANGE, "layer range [%d, %d) is not a non-empty range inside [0, %lld)",
                    params->layer_begin, params->layer_end, (long long) meta.n_layer);
    }
    if (params->load_mtp) {
        // the MTP block reads the final hidden state: only the last shard has it (contract in
        // docs/speculative.md); llama.cpp's covered MTP graph is DeepSeek V4's (graph_mtp)
        if (meta.n_layer_nextn <= 0) {
            return fail(DGR_E_UNSUPPORTED, "'%s' has no MTP block (%s.nextn_predict_layers is 0 or absent): "
                        "nothing to load with load_mtp", params->model_path, meta.arch.c_str());
        }
        if (meta.arch != "deepseek4") {
            return fail(DGR_E_UNSUPPORTED, "MTP drafting is covered for deepseek4 only, not '%s'", meta.arch.c_str());
        }
        if (meta.n_layer_nextn != 1) {
            return fail(DGR_E_UNSUPPORTED, "llama.cpp's DeepSeek V4 MTP graph runs one nextn block, '%s' has %lld",
                        params->model_path, (long long) meta.n_layer_nextn);
        }
        if (l_end != meta.n_layer) {
            return fail(DGR_E_UNSUPPORTED, "the MTP block belongs to the last shard (the one ending at layer %lld, "
                        "which holds the final hidden state); this shard owns [%d, %d)",
                        (long long) meta.n_layer, l_begin, l_end);
        }
        if (l_begin != 0 && !meta.has_nextn_embed) {
            return fail(DGR_E_UNSUPPORTED, "the MTP block of '%s' has no nextn.embed_tokens and a last shard "
                        "that is not the first does not load token_embd: open the whole model, or use a file "
                        "whose MTP block carries its embeddings", params->model_path);
        }
    }

    auto engine = std::make_unique<dgr_engine>();
    engine->params = *params;
    engine->model_path = params->model_path;
    engine->params.model_path = engine->model_path.c_str();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mode = LLAMA_LOAD_MODE_NONE;  // read owned tensors only: no mmap, no whole-file prefetch
    mp.lazy_mode = LLAMA_LAZY_MODE_OFF;
    mp.load_mtp = params->load_mtp != 0;
    mp.layer_begin = l_begin;
    mp.layer_end = l_end;
    g_llama_last_log_error.clear();
    engine->model = llama_model_load_from_file(params->model_path, mp);
    if (engine->model == nullptr) {
        return fail(DGR_E_MODEL_LOAD, "llama.cpp could not load '%s' layers [%d, %d): %s", params->model_path, l_begin,
                    l_end, g_llama_last_log_error.empty() ? "see DGR_LLAMA_LOG=1" : g_llama_last_log_error.c_str());
    }

    if (llama_model_n_layer(engine->model) != meta.n_layer) {
        // e.g. nextn_predict_layers set but the MTP tensors absent: the ranges would not line up
        return fail(DGR_E_MODEL_LOAD, "GGUF '%s' declares %lld main layers (block_count less nextn_predict_layers) "
                    "but llama.cpp loaded %d", params->model_path, (long long) meta.n_layer,
                    llama_model_n_layer(engine->model));
    }

    const bool is_first = l_begin == 0;
    const bool is_last = l_end == meta.n_layer;

    llama_context_params cp = llama_context_default_params();
    cp.n_seq_max = params->max_sessions;
    cp.n_ctx = params->max_sessions * params->n_ctx_per_session;
    cp.kv_unified = false;  // one KV stream per session: sessions never see each other's cells
    cp.n_batch = params->n_batch;
    cp.n_ubatch = std::min(params->n_ubatch, params->n_batch);
    cp.n_threads = params->n_threads;
    cp.n_threads_batch = params->n_threads;
    cp.embeddings = !is_last;  // a non-last shard's output is the boundary (t_embd)
    cp.pooling_type = LLAMA_POOLING_TYPE_NONE;
    cp.no_perf = true;
    cp.type_k = kv_type;
    cp.type_v = kv_type;
    cp.flash_attn_type = flash_attn;
    if (meta.arch == "deepseek4") {
        // snapshots of the compressor and indexer state for the newest positions, so that the
        // rejected drafts of a verification pass can be dropped (dgr_session_truncate)
        cp.n_rs_seq = DGR_V4_ROLLBACK_ROWS;
    }
    engine->ctx = llama_init_from_model(engine->model, cp);
    if (engine->ctx == nullptr) {
        return fail(DGR_E_MODEL_LOAD, "llama.cpp could not create a context for '%s': %s", params->model_path,
                    g_llama_last_log_error.empty() ? "see DGR_LLAMA_LOG=1" : g_llama_last_log_error.c_str());
    }
    if (params->load_mtp) {
        // as llama.cpp's draft-mtp does: the target keeps every row's hidden state (unmasked),
        // the MTP context (its own KV of the nextn layer) outputs its own for the rows asked
        llama_context_params mcp = cp;
        mcp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
        mcp.embeddings = false;
        mcp.n_rs_seq = 0;
        mcp.ctx_other = engine->ctx;
        engine->mtp_ctx = llama_init_from_model(engine->model, mcp);
        if (engine->mtp_ctx == nullptr) {
            return fail(DGR_E_MODEL_LOAD, "llama.cpp could not create the MTP context for '%s': %s", params->model_path,
                        g_llama_last_log_error.empty() ? "see DGR_LLAMA_LOG=1" : g_llama_last_log_error.c_str());
        }
        llama_set_embeddings_nextn(engine->ctx, true, /*masked =*/ false);
        llama_set_embeddings_nextn(engine->mtp_ctx, true, /*masked =*/ true);
    }

    dgr_shard_info & info = engine->info;
    std::snprintf(info.arch, sizeof(info.arch), "%s", meta.arch.c_str());
    info.n_layer = (int32_t) meta.n_layer;
    info.layer_begin = l_begin;
    info.layer_end = l_end;
    info.n_embd = llama_model_n_embd(engine->model);
    info.n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(engine->model));
    info.in_width = is_first ? 0 : llama_model_n_embd_inp(engine->model);
    info.out_width = is_last ? info.n_vocab : llama_model_n_embd_out(engine->model);
    info.is_first = is_first;
    info.is_last = is_last;
    // the first shard embeds tokens; a later one owning a hash-routed layer (il < hash_layer_count,
    // DeepSeek V4) selects that layer's experts by token id, so the ids ride with its rows
    engine->main_needs_tokens = is_first || l_begin < meta.hash_layer_count;
    // the MTP block embeds the token of every row it catches up on
    info.needs_token_ids = engine->main_needs_tokens || params->load_mtp;
    engine->hash_layer_count = (int32_t) std::min<int64_t>(meta.hash_layer_count, meta.n_layer);
    info.mtp_owner = is_last;  // the role; the block is loaded only with load_mtp
    info.max_sessions = params->max_sessions;
    info.n_ctx_per_session = llama_n_ctx_seq(engine->ctx);
    info.n_batch = llama_n_batch(engine->ctx);

    for (int32_t s = (int32_t) params->max_sessions - 1; s >= 0; --s) {
        engine->free_seqs.push_back(s);
    }
    *out = engine.release();
    return ok();
    DGR_GUARD_END
}

void dgr_engine_free(dgr_engine * engine) { delete engine; }

int dgr_engine_info(const dgr_engine * engine, dgr_shard_info * out) {
    if (engine == nullptr || out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine and out must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    *out = engine->info;
    return ok();
}

int dgr_engine_stats_get(const dgr_engine * engine, dgr_engine_stats * out) {
    if (engine == nullptr || out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine and out must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    DGR_GUARD_BEGIN
    dgr_engine_stats s{};
    for (const auto & [buft, mb] : llama_get_memory_breakdown(engine->ctx)) {
        (void) buft;
        s.weight_bytes += mb.model;
        s.kv_bytes += mb.context;
        s.compute_bytes += mb.compute;
    }
    s.rss_bytes = read_proc_status_kb("VmRSS:") * 1024;
    s.peak_rss_bytes = read_proc_status_kb("VmHWM:") * 1024;
    s.open_sessions = (uint32_t) engine->sessions.size();
    s.rows_forwarded = engine->rows_forwarded;
    s.forward_calls = engine->forward_calls;
    s.forward_ns = engine->forward_ns;
    *out = s;
    return ok();
    DGR_GUARD_END
}

int dgr_session_open(dgr_engine * engine, uint64_t session_id, uint64_t epoch) {
    if (engine == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    DGR_GUARD_BEGIN
    auto it = engine->sessions.find(session_id);
    if (it != engine->sessions.end()) {
        session_slot & slot = it->second;
        if (epoch < slot.epoch) {
            return fail_stale(slot.epoch, "session %llu: epoch %llu is stale (current epoch %llu)",
                              (unsigned long long) session_id, (unsigned long long) epoch,
                              (unsigned long long) slot.epoch);
        }
        if (epoch > slot.epoch) {
            // cache miss: the older epoch's state is discarded, the new epoch starts empty
            engine->clear_seq(slot);
            slot.epoch = epoch;
            slot.next_pos = 0;
            slot.rollback_rows = 0;
        }
        return ok();
    }
    if (engine->free_seqs.empty()) {
        return fail(DGR_E_CAPACITY, "no free session slot: %u sessions open (max_sessions)",
                    (unsigned) engine->sessions.size());
    }
    // the lowest free sequence: open sessions keep neighbouring ids, which llama.cpp evaluates
    // together when a co-batched forward (dgr_forward_batch) carries several of them
    const auto lowest = std::min_element(engine->free_seqs.begin(), engine->free_seqs.end());
    session_slot slot;
    slot.epoch = epoch;
    slot.seq = *lowest;
    engine->clear_seq(slot);
    engine->sessions.emplace(session_id, slot);
    engine->free_seqs.erase(lowest);  // only once the session holds the slot
    return ok();
    DGR_GUARD_END
}

int dgr_session_close(dgr_engine * engine, uint64_t session_id, uint64_t epoch) {
    if (engine == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    DGR_GUARD_BEGIN
    session_slot * slot = nullptr;
    if (int rc = engine->find(session_id, epoch, &slot); rc != DGR_OK) {
        return rc;
    }
    engine->clear_seq(*slot);
    engine->free_seqs.push_back(slot->seq);
    engine->sessions.erase(session_id);
    return ok();
    DGR_GUARD_END
}

}  // extern "C"

namespace {

// Micro-batches of fewer rows than this are computed column by column: llamafile's sgemm takes
// only larger ones (patch 0010). A co-batched llama_decode stays under it, so that a session's
// rows have the same bits next to other sessions' rows as alone.
constexpr uint32_t k_uniform_rows = 32;

// Rows of the last forward call whose hidden states an MTP engine keeps per session, so that a
// truncation into that call (rejected draft rows) can restore pending_h.
constexpr size_t k_mtp_kept_rows = 64;

// One llama_batch_ext row: token id at pos with the "state" row h (the MTP block's inputs).
bool mtp_add_row(llama_batch_ext * b, llama_seq_id seq, llama_token token, llama_pos pos, const float * h,
                 size_t width, bool output) {
    const int32_t idx = llama_batch_ext_add_token(b, seq, token);
    return idx >= 0 && llama_batch_ext_set_pos(b, idx, &pos) &&
           llama_batch_ext_set_embd_token(b, idx, llama_embd{h, 1, width}) &&
           llama_batch_ext_set_output_logits(b, idx, output);
}

// The MTP catch-up after a successful forward of `n` rows from batch row `first` (llama.cpp's
// draft-mtp process()): the MTP context decodes the same tokens at the same positions, row i
// paired with the target's hidden state of row i - 1 (row 0 with pending_h). Then pending_h is
// the last row's. Returns false (message via fail()) when the MTP decode failed; the caller
// rolls the call back.
int mtp_catch_up(dgr_engine * engine, session_slot & slot, const int32_t * tokens, int32_t first, uint32_t n) {
    const size_t width = (size_t) llama_model_n_embd_out(engine->model);
    mtp_slot & m = slot.mtp;
    if (!m.ok) {
        return DGR_OK;  // inputs lost: the MTP context stays behind until a new epoch
    }
    if (mtp_end(m) != slot.next_pos) {
        // drafted as from an earlier position and never truncated to it: its rows are gone
        llama_memory_seq_rm(llama_get_memory(engine->mtp_ctx), slot.seq, -1, -1);
        m.ok = false;
        return DGR_OK;
    }
    std::vector<const float *> h(n);
    for (uint32_t i = 0; i < n; ++i) {
        h[i] = llama_get_embeddings_nextn_ith(engine->ctx, first + (int32_t) i);
        if (h[i] == nullptr) {
            return fail(DGR_E_DECODE, "session slot %d: no hidden state for row %u", slot.seq, i);
        }
    }
    llama_batch_ext * b = llama_batch_ext_init(engine->mtp_ctx);
    bool added = b != nullptr;
    for (uint32_t i = 0; added && i < n; ++i) {
        added = mtp_add_row(b, slot.seq, tokens[i], slot.next_pos + (llama_pos) i,
                            i == 0 ? m.pending_h.data() : h[i - 1], width, false);
    }
    g_llama_last_log_error.clear();
    const int32_t rc = added ? llama_process(engine->mtp_ctx, LLAMA_PROCESS_TYPE_DECODE, b) : -1;
    llama_batch_ext_free(b);
    if (rc != 0) {
        return fail(DGR_E_DECODE, "the MTP block's catch-up decode returned %d: %s", rc,
                    added ? g_llama_last_log_error.c_str() : "could not build its batch");
    }
    const size_t kept = std::min<size_t>(n, k_mtp_kept_rows);
    m.rows_begin = slot.next_pos + (int32_t) (n - kept);
    m.before_h = kept == n ? m.pending_h : std::vector<float>(h[n - kept - 1], h[n - kept - 1] + width);
    m.rows_h.resize(kept * width);
    for (size_t i = 0; i < kept; ++i) {
        std::memcpy(m.rows_h.data() + i * width, h[n - kept + i], width * sizeof(float));
    }
    std::memcpy(m.pending_h.data(), h[n - 1], width * sizeof(float));
    return DGR_OK;
}

// One session's rows in a forward call, checked and ready to run.
struct forward_plan {
    dgr_forward_item * item = nullptr;
    session_slot * slot = nullptr;
    std::vector<uint32_t> out_rows;  // rows (of the item) that produce an output
};

// Checks one item against the engine (status and message via fail(); nothing changes).
int check_item(dgr_engine * engine, dgr_forward_item & it, forward_plan & plan) {
    if (it.positions == nullptr || it.out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine, positions, out and n_out must not be NULL");
    }
    session_slot * slot = nullptr;
    if (int rc = engine->find(it.session_id, it.epoch, &slot); rc != DGR_OK) {
        return rc;
    }
    const dgr_shard_info & info = engine->info;
    const uint64_t session_id = it.session_id;
    const uint32_t n_rows = it.n_rows;
    if (n_rows == 0) {
        return fail(DGR_E_SHAPE, "session %llu: a forward call needs at least one row", (unsigned long long) session_id);
    }
    if (n_rows > info.n_batch) {
        return fail(DGR_E_SHAPE, "session %llu: %u rows exceed n_batch %u", (unsigned long long) session_id, n_rows,
                    info.n_batch);
    }
    if (info.is_first) {
        if (it.rows != nullptr) {
            return fail(DGR_E_SHAPE, "the first shard takes token ids, not boundary rows");
        }
    } else {
        if (it.rows == nullptr) {
            return fail(DGR_E_SHAPE, "shard [%d, %d) is not the first: it needs boundary rows of width %d",
                        info.layer_begin, info.layer_end, info.in_width);
        }
        if ((int32_t) it.row_width != info.in_width) {
            return fail(DGR_E_SHAPE, "boundary row width %u does not match this shard's input width %d", it.row_width,
                        info.in_width);
        }
    }
    if (info.needs_token_ids) {
        if (it.tokens == nullptr) {
            if (info.is_first) {
                return fail(DGR_E_SHAPE, "shard [%d, %d) needs token ids with its rows", info.layer_begin,
                            info.layer_end);
            }
            return fail(DGR_E_SHAPE,
                        "shard [%d, %d) owns hash-routed layers [%d, %d): its boundary rows need the token ids "
                        "that route their experts",
                        info.layer_begin, info.layer_end, info.layer_begin,
                        std::min(info.layer_end, engine->hash_layer_count));
        }
        for (uint32_t i = 0; i < n_rows; ++i) {
            if (it.tokens[i] < 0 || it.tokens[i] >= info.n_vocab) {
                return fail(DGR_E_INVALID_ARGUMENT, "token id %d at row %u is outside the vocabulary [0, %d)",
                            it.tokens[i], i, info.n_vocab);
            }
        }
    }
    for (uint32_t i = 0; i < n_rows; ++i) {
        if (it.positions[i] != slot->next_pos + (int32_t) i) {
            return fail(DGR_E_POSITION, "session %llu: row %u has position %d but the KV continues at %d",
                        (unsigned long long) session_id, i, it.positions[i], slot->next_pos + (int32_t) i);
        }
    }
    if ((uint64_t) slot->next_pos + n_rows > info.n_ctx_per_session) {
        return fail(DGR_E_CONTEXT_FULL, "session %llu: %d + %u positions exceed the session context of %u",
                    (unsigned long long) session_id, slot->next_pos, n_rows, info.n_ctx_per_session);
    }
    plan.out_rows.clear();
    for (uint32_t i = 0; i < n_rows; ++i) {
        if (!info.is_last || (it.want == nullptr ? i + 1 == n_rows : it.want[i] != 0)) {
            plan.out_rows.push_back(i);
        }
    }
    const size_t need = plan.out_rows.size() * (size_t) info.out_width;
    if (it.out_capacity < need) {
        return fail(DGR_E_SHAPE, "output buffer holds %zu floats, %zu needed", it.out_capacity, need);
    }
    plan.item = &it;
    plan.slot = slot;
    return DGR_OK;
}

// Runs checked plans (distinct sessions, rows together <= n_batch) in one llama_decode, their
// rows in plan order. On failure every plan's session is rolled back (or emptied, see
// roll_back) and the status and message say so; on success each item's n_out is set and each
// session's next position advances by its rows.
int run_plans(dgr_engine * engine, std::vector<forward_plan *> & plans) {
    const dgr_shard_info & info = engine->info;
    int32_t n_total = 0;
    for (const forward_plan * plan : plans) {
        n_total += (int32_t) plan->item->n_rows;
    }
    const auto t0 = std::chrono::steady_clock::now();
    llama_batch batch = llama_batch_init(n_total, info.is_first ? 0 : info.in_width, 1);
    batch.n_tokens = n_total;
    if (!info.is_first && engine->main_needs_tokens) {
        // boundary rows and the token ids they carry, in one batch (llama_batch_free frees both)
        batch.token = (llama_token *) std::malloc(sizeof(llama_token) * (size_t) n_total);
        if (batch.token == nullptr) {
            llama_batch_free(batch);
            return fail(DGR_E_INTERNAL, "out of memory for %d token ids", n_total);
        }
    }
    std::vector<int32_t> first_row(plans.size());
    int32_t at = 0;
    for (size_t p = 0; p < plans.size(); ++p) {
        const dgr_forward_item & it = *plans[p]->item;
        first_row[p] = at;
        if (info.is_first || engine->main_needs_tokens) {
            std::memcpy(batch.token + at, it.tokens, sizeof(int32_t) * it.n_rows);
        }
        if (!info.is_first) {
            std::memcpy(batch.embd + (size_t) at * info.in_width, it.rows,
                        sizeof(float) * it.n_rows * (size_t) info.in_width);
        }
        for (uint32_t i = 0; i < it.n_rows; ++i) {
            batch.pos[at + i] = it.positions[i];
            batch.n_seq_id[at + i] = 1;
            batch.seq_id[at + i][0] = plans[p]->slot->seq;
            batch.logits[at + i] = 0;
        }
        for (uint32_t i : plans[p]->out_rows) {
            batch.logits[at + i] = 1;
        }
        at += (int32_t) it.n_rows;
    }
    g_llama_last_log_error.clear();
    const int32_t rc = llama_decode(engine->ctx, batch);
    llama_batch_free(batch);
    const uint64_t session_id = plans.size() == 1 ? plans[0]->item->session_id : 0;
    if (rc != 0) {
        if (rc == 1) {
            // llama.cpp restored the memory itself: the sessions keep their state and position
            if (plans.size() == 1) {
                return fail(DGR_E_CONTEXT_FULL, "session %llu: no KV slot for %d rows", (unsigned long long) session_id,
                            n_total);
            }
            return fail(DGR_E_CONTEXT_FULL, "no KV slot for %d rows of %zu sessions", n_total, plans.size());
        }
        // roll the rows of this call back: each session keeps its previous state and position;
        // state that cannot drop a tail (DeepSeek V4 compressed/indexer state) is emptied instead
        const char * what = "";
        for (forward_plan * plan : plans) {
            what = engine->roll_back(*plan->slot);
        }
        if (plans.size() == 1) {
            return fail(DGR_E_DECODE, "session %llu: llama_decode returned %d: %s; %s", (unsigned long long) session_id,
                        rc, g_llama_last_log_error.c_str(), what);
        }
        return fail(DGR_E_DECODE, "llama_decode of %zu sessions returned %d: %s; for each session %s", plans.size(),
                    rc, g_llama_last_log_error.c_str(), what);
    }
    for (size_t p = 0; p < plans.size(); ++p) {
        dgr_forward_item & it = *plans[p]->item;
        const std::vector<uint32_t> & out_rows = plans[p]->out_rows;
        for (size_t k = 0; k < out_rows.size(); ++k) {
            const int32_t row = first_row[p] + (int32_t) out_rows[k];
            const float * src = info.is_last ? llama_get_logits_ith(engine->ctx, row)
                                             : llama_get_embeddings_ith(engine->ctx, row);
            if (src == nullptr) {
                const char * what = "";
                for (forward_plan * plan : plans) {
                    what = engine->roll_back(*plan->slot);
                }
                return fail(DGR_E_DECODE, "session %llu: no output for row %u; %s",
                            (unsigned long long) it.session_id, out_rows[k], what);
            }
            std::memcpy(it.out + k * (size_t) info.out_width, src, sizeof(float) * (size_t) info.out_width);
        }
    }
    if (engine->mtp_ctx != nullptr) {
        for (size_t p = 0; p < plans.size(); ++p) {
            if (int rc = mtp_catch_up(engine, *plans[p]->slot, plans[p]->item->tokens, first_row[p],
                                      plans[p]->item->n_rows);
                rc != DGR_OK) {
                const std::string why = g_last_error;
                const char * what = "";
                for (forward_plan * plan : plans) {
                    what = engine->roll_back(*plan->slot);
                }
                return fail(DGR_E_DECODE, "%s; %s", why.c_str(), what);
            }
        }
    }
    for (forward_plan * plan : plans) {
        plan->slot->next_pos += (int32_t) plan->item->n_rows;
        // one micro-batch: its snapshots are those of the newest rows
        plan->slot->rollback_rows = plan->item->n_rows <= llama_n_ubatch(engine->ctx) ? (int32_t) plan->item->n_rows : 0;
        plan->item->n_out = (uint32_t) plan->out_rows.size();
    }
    engine->rows_forwarded += (uint64_t) n_total;
    engine->forward_calls += 1;
    engine->forward_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - t0)
                              .count();
    return DGR_OK;
}

// Records the calling thread's last failure in the item.
void record_failure(dgr_forward_item & it, int status) {
    it.status = status;
    it.held_epoch = g_last_held_epoch;
    std::snprintf(it.error, sizeof(it.error), "%s", g_last_error.c_str());
}

}  // namespace

extern "C" {

int dgr_session_forward(dgr_engine * engine, uint64_t session_id, uint64_t epoch, uint32_t n_rows,
                        const int32_t * tokens, const float * rows, uint32_t row_width, const int32_t * positions,
                        const uint8_t * want, float * out, size_t out_capacity, uint32_t * n_out) {
    if (engine == nullptr || n_out == nullptr || out == nullptr || positions == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine, positions, out and n_out must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    *n_out = 0;
    DGR_GUARD_BEGIN
    dgr_forward_item it{};
    it.session_id = session_id;
    it.epoch = epoch;
    it.n_rows = n_rows;
    it.tokens = tokens;
    it.rows = rows;
    it.row_width = row_width;
    it.positions = positions;
    it.want = want;
    it.out = out;
    it.out_capacity = out_capacity;
    forward_plan plan;
    if (int rc = check_item(engine, it, plan); rc != DGR_OK) {
        return rc;
    }
    std::vector<forward_plan *> plans{ &plan };
    if (int rc = run_plans(engine, plans); rc != DGR_OK) {
        return rc;
    }
    *n_out = it.n_out;
    return ok();
    DGR_GUARD_END
}

int dgr_forward_batch(dgr_engine * engine, dgr_forward_item * items, uint32_t n_items) {
    if (engine == nullptr || (items == nullptr && n_items > 0)) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine and items must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    DGR_GUARD_BEGIN
    std::vector<forward_plan> plans(n_items);
    std::vector<forward_plan *> ready;
    uint32_t n_total = 0;
    for (uint32_t i = 0; i < n_items; ++i) {
        dgr_forward_item & it = items[i];
        it.n_out = 0;
        it.status = DGR_OK;
        it.held_epoch = -1;
        it.error[0] = '\0';
        bool twice = false;
        for (const forward_plan * other : ready) {
            twice = twice || other->item->session_id == it.session_id;
        }
        if (twice) {
            fail(DGR_E_INVALID_ARGUMENT, "session %llu appears twice in one batch", (unsigned long long) it.session_id);
            record_failure(it, DGR_E_INVALID_ARGUMENT);
            continue;
        }
        if (int rc = check_item(engine, it, plans[i]); rc != DGR_OK) {
            record_failure(it, rc);
            continue;
        }
        ready.push_back(&plans[i]);
        n_total += it.n_rows;
    }
    if (n_total > engine->info.n_batch) {
        return fail(DGR_E_SHAPE, "%u rows of %zu sessions exceed n_batch %u; nothing ran", n_total, ready.size(),
                    engine->info.n_batch);
    }
    // llama.cpp splits a batch over per-sequence KV streams into micro-batches of consecutive
    // sequence ids: in sequence order, neighbouring slots share one graph evaluation
    std::sort(ready.begin(), ready.end(),
              [](const forward_plan * a, const forward_plan * b) { return a->slot->seq < b->slot->seq; });
    // deepseek4 state is per session and not covered by multi-sequence batches: one call each
    const bool together = std::strcmp(engine->info.arch, "deepseek4") != 0;
    for (size_t begin = 0; begin < ready.size();) {
        // neighbours share a llama_decode while they stay under k_uniform_rows rows together:
        // every micro-batch is then computed column by column (patch 0010), so each row comes
        // out in the bits it has when its session runs alone; a larger item runs alone
        size_t end = begin + 1;
        uint32_t rows = ready[begin]->item->n_rows;
        while (together && end < ready.size() && rows + ready[end]->item->n_rows < k_uniform_rows) {
            rows += ready[end]->item->n_rows;
            ++end;
        }
        std::vector<forward_plan *> group(ready.begin() + (std::ptrdiff_t) begin, ready.begin() + (std::ptrdiff_t) end);
        if (int rc = run_plans(engine, group); rc != DGR_OK) {
            for (forward_plan * plan : group) {
                record_failure(*plan->item, rc);
            }
        } else {
            for (forward_plan * plan : group) {
                plan->item->status = DGR_OK;
            }
        }
        begin = end;
    }
    return ok();
    DGR_GUARD_END
}

int dgr_session_truncate(dgr_engine * engine, uint64_t session_id, uint64_t epoch, int32_t n_keep) {
    if (engine == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    DGR_GUARD_BEGIN
    session_slot * slot = nullptr;
    if (int rc = engine->find(session_id, epoch, &slot); rc != DGR_OK) {
        return rc;
    }
    if (n_keep < 0 || n_keep > slot->next_pos) {
        return fail(DGR_E_POSITION, "session %llu: cannot keep %d positions of %d", (unsigned long long) session_id,
                    n_keep, slot->next_pos);
    }
    if (n_keep == slot->next_pos) {
        return ok();  // nothing to drop
    }
    if (n_keep > 0 && std::strcmp(engine->info.arch, "deepseek4") == 0) {
        // the compressed (CSA/HCA) and indexer state drops a tail only from its snapshots of the
        // last call's rows (llama.cpp n_rs_seq), once
        const int32_t drop = slot->next_pos - n_keep;
        if (drop > slot->rollback_rows || drop > DGR_V4_ROLLBACK_ROWS ||
            !llama_memory_seq_rm(engine->mem(), slot->seq, n_keep, -1)) {
            return fail(DGR_E_UNSUPPORTED,
                        "session %llu: DeepSeek V4 state cannot be truncated to %d of %d positions: only the "
                        "rows of the last forward call (%d, at most %d) can be dropped, once; re-prefill under "
                        "a new epoch instead",
                        (unsigned long long) session_id, n_keep, slot->next_pos, slot->rollback_rows,
                        DGR_V4_ROLLBACK_ROWS);
        }
        if (engine->mtp_ctx != nullptr) {
            engine->mtp_truncate(*slot, n_keep);  // the MTP KV drops the same tail
        }
        slot->next_pos = n_keep;
        slot->rollback_rows = 0;
        return ok();
    }
    if (!llama_memory_seq_rm(engine->mem(), slot->seq, n_keep, -1)) {
        return fail(DGR_E_INTERNAL, "session %llu: llama.cpp refused to drop positions >= %d",
                    (unsigned long long) session_id, n_keep);
    }
    slot->next_pos = n_keep;
    slot->rollback_rows = 0;
    if (engine->mtp_ctx != nullptr) {
        engine->mtp_truncate(*slot, n_keep);
    }
    return ok();
    DGR_GUARD_END
}

int dgr_session_next_pos(const dgr_engine * engine, uint64_t session_id, uint64_t epoch, int32_t * out) {
    if (engine == nullptr || out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine and out must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    session_slot * slot = nullptr;
    if (int rc = const_cast<dgr_engine *>(engine)->find(session_id, epoch, &slot); rc != DGR_OK) {
        return rc;
    }
    *out = slot->next_pos;
    return ok();
}

namespace {

// The drafts of dgr_session_mtp_draft and dgr_session_mtp_draft_from: n_keep < 0 drafts from
// the session's next position, else as from position n_keep (the MTP context first drops its
// rows from n_keep; the main sequence is left alone).
int mtp_draft_impl(dgr_engine * engine, uint64_t session_id, uint64_t epoch, int32_t n_keep, int32_t last_token,
                   uint32_t k, int32_t * out, uint32_t * n_out) {
    if (engine == nullptr || n_out == nullptr || (out == nullptr && k > 0)) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine, n_out and (for k > 0) out must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    *n_out = 0;
    if (engine->mtp_ctx == nullptr) {
        return fail(DGR_E_UNSUPPORTED, "this engine has no MTP block: it is opened with load_mtp on the last shard "
                    "of a model that has one");
    }
    session_slot * slot = nullptr;
    if (int rc = engine->find(session_id, epoch, &slot); rc != DGR_OK) {
        return rc;
    }
    const dgr_shard_info & info = engine->info;
    if (last_token < 0 || last_token >= info.n_vocab) {
        return fail(DGR_E_INVALID_ARGUMENT, "token id %d is outside the vocabulary [0, %d)", last_token, info.n_vocab);
    }
    mtp_slot & m = slot->mtp;
    if (!m.ok) {
        return fail(DGR_E_UNSUPPORTED, "session %llu: its MTP inputs were lost (a saved state was loaded or it was "
                    "truncated before its last forward): re-prefill under a new epoch to draft again",
                    (unsigned long long) session_id);
    }
    const int32_t end = mtp_end(m);
    if (n_keep >= 0) {
        // as from position n_keep: only the MTP context drops its rows from there (the main
        // sequence keeps them until its own dgr_session_truncate to the same n_keep)
        if (n_keep < 1 || n_keep > slot->next_pos) {
            return fail(DGR_E_POSITION, "session %llu: cannot draft as from position %d: it must be in [1, %d]",
                        (unsigned long long) session_id, n_keep, slot->next_pos);
        }
        if (n_keep < m.rows_begin || n_keep > end) {
            return fail(DGR_E_UNSUPPORTED,
                        "session %llu: the MTP block can draft as from positions %d..%d only (the rows of the last "
                        "forward call it holds), not %d; nothing changed",
                        (unsigned long long) session_id, m.rows_begin, end, n_keep);
        }
        if (n_keep < end) {
            engine->mtp_truncate(*slot, n_keep);
            if (!m.ok) {
                return fail(DGR_E_INTERNAL, "session %llu: llama.cpp refused to drop the MTP rows from %d; its MTP "
                            "inputs are lost until a new epoch", (unsigned long long) session_id, n_keep);
            }
        }
    } else if (end != slot->next_pos) {
        return fail(DGR_E_UNSUPPORTED, "session %llu: the MTP block drafted as from position %d: truncate the "
                    "session to it (or draft as from it) first", (unsigned long long) session_id, end);
    }
    // the drafts take positions start.. of the MTP KV (dropped again below): stop where the
    // session's context ends
    const int32_t start = n_keep >= 0 ? n_keep : slot->next_pos;
    const uint32_t room = (uint32_t) std::max<int64_t>(0, (int64_t) info.n_ctx_per_session - start);
    const uint32_t n = std::min(k, room);
    const size_t width = m.pending_h.size();
    std::vector<float> h(m.pending_h);
    llama_memory_t mem = llama_get_memory(engine->mtp_ctx);
    llama_batch_ext * b = llama_batch_ext_init(engine->mtp_ctx);
    if (b == nullptr) {
        return fail(DGR_E_INTERNAL, "could not allocate the MTP batch");
    }
    llama_token token = last_token;
    uint32_t made = 0;
    int status = DGR_OK;
    for (uint32_t i = 0; i < n; ++i) {
        // (x_{P+i}, h_{P+i-1}) -> the argmax is the draft for P+i+1; the block's own output
        // streams are the next step's h (llama.cpp's draft-mtp draft(), greedy)
        llama_batch_ext_clear(b);
        if (!mtp_add_row(b, slot->seq, token, start + (llama_pos) i, h.data(), width, true)) {
            status = fail(DGR_E_INTERNAL, "could not build the MTP batch");
            break;
        }
        g_llama_last_log_error.clear();
        const int32_t rc = llama_process(engine->mtp_ctx, LLAMA_PROCESS_TYPE_DECODE, b);
        const float * logits = rc == 0 ? llama_get_logits_ith(engine->mtp_ctx, 0) : nullptr;
        const float * h_next = rc == 0 ? llama_get_embeddings_nextn_ith(engine->mtp_ctx, 0) : nullptr;
        if (logits == nullptr || h_next == nullptr) {
            status = fail(DGR_E_DECODE, "session %llu: the MTP draft decode returned %d: %s; the session is unchanged",
                          (unsigned long long) session_id, rc, g_llama_last_log_error.c_str());
            break;
        }
        int32_t best = 0;
        for (int32_t v = 1; v < info.n_vocab; ++v) {
            if (logits[v] > logits[best]) {
                best = v;  // first maximum: the lowest id wins a tie, as numpy's argmax
            }
        }
        out[made++] = best;
        token = best;
        std::memcpy(h.data(), h_next, width * sizeof(float));
    }
    llama_batch_ext_free(b);
    // the MTP KV holds [0, next_pos) again: the draft rows are not the session's (llama.cpp's
    // server drops them the same way right after drafting)
    if (!llama_memory_seq_rm(mem, slot->seq, start, -1)) {
        llama_memory_seq_rm(mem, slot->seq, -1, -1);
        m.ok = false;
        return fail(DGR_E_INTERNAL, "session %llu: llama.cpp refused to drop the MTP draft rows; its MTP inputs "
                    "are lost until a new epoch", (unsigned long long) session_id);
    }
    if (status != DGR_OK) {
        return status;
    }
    *n_out = made;
    return ok();
}

}  // namespace

int dgr_session_mtp_draft(dgr_engine * engine, uint64_t session_id, uint64_t epoch, int32_t last_token,
                          uint32_t k, int32_t * out, uint32_t * n_out) {
    DGR_GUARD_BEGIN
    return mtp_draft_impl(engine, session_id, epoch, -1, last_token, k, out, n_out);
    DGR_GUARD_END
}

int dgr_session_mtp_draft_from(dgr_engine * engine, uint64_t session_id, uint64_t epoch, int32_t n_keep,
                               int32_t last_token, uint32_t k, int32_t * out, uint32_t * n_out) {
    DGR_GUARD_BEGIN
    if (n_keep < 1) {
        return fail(DGR_E_POSITION, "session %llu: cannot draft as from position %d: it must be at least 1",
                    (unsigned long long) session_id, n_keep);
    }
    return mtp_draft_impl(engine, session_id, epoch, n_keep, last_token, k, out, n_out);
    DGR_GUARD_END
}

namespace {

struct state_header {
    uint32_t magic;
    uint32_t version;
    int32_t layer_begin;
    int32_t layer_end;
    int32_t in_width;
    int32_t out_width;
    int32_t next_pos;
    uint32_t reserved;
    uint64_t payload_size;
};

}  // namespace

int dgr_session_state_size(dgr_engine * engine, uint64_t session_id, uint64_t epoch, size_t * out) {
    if (engine == nullptr || out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine and out must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    DGR_GUARD_BEGIN
    session_slot * slot = nullptr;
    if (int rc = engine->find(session_id, epoch, &slot); rc != DGR_OK) {
        return rc;
    }
    *out = sizeof(state_header) + llama_state_seq_get_size(engine->ctx, slot->seq);
    return ok();
    DGR_GUARD_END
}

int dgr_session_state_save(dgr_engine * engine, uint64_t session_id, uint64_t epoch, uint8_t * buf, size_t capacity,
                           size_t * written) {
    if (engine == nullptr || buf == nullptr || written == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine, buf and written must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    *written = 0;
    DGR_GUARD_BEGIN
    session_slot * slot = nullptr;
    if (int rc = engine->find(session_id, epoch, &slot); rc != DGR_OK) {
        return rc;
    }
    const size_t payload = llama_state_seq_get_size(engine->ctx, slot->seq);
    if (capacity < sizeof(state_header) + payload) {
        return fail(DGR_E_SHAPE, "state buffer holds %zu bytes, %zu needed", capacity, sizeof(state_header) + payload);
    }
    state_header h{};
    h.magic = DGR_STATE_MAGIC;
    h.version = DGR_STATE_VERSION;
    h.layer_begin = engine->info.layer_begin;
    h.layer_end = engine->info.layer_end;
    h.in_width = engine->info.in_width;
    h.out_width = engine->info.out_width;
    h.next_pos = slot->next_pos;
    const size_t n = llama_state_seq_get_data(engine->ctx, buf + sizeof(h), payload, slot->seq);
    if (n == 0 && payload != 0) {
        return fail(DGR_E_STATE, "llama.cpp could not serialise session %llu", (unsigned long long) session_id);
    }
    h.payload_size = n;
    std::memcpy(buf, &h, sizeof(h));
    *written = sizeof(h) + n;
    return ok();
    DGR_GUARD_END
}

int dgr_session_state_load(dgr_engine * engine, uint64_t session_id, uint64_t epoch, const uint8_t * buf, size_t size) {
    if (engine == nullptr || buf == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "engine and buf must not be NULL");
    }
    const engine_lock hold(engine->call_mutex);  // links and the binding share the engine
    DGR_GUARD_BEGIN
    session_slot * slot = nullptr;
    if (int rc = engine->find(session_id, epoch, &slot); rc != DGR_OK) {
        return rc;
    }
    state_header h{};
    if (size < sizeof(h)) {
        return fail(DGR_E_STATE, "saved state of %zu bytes is shorter than its header", size);
    }
    std::memcpy(&h, buf, sizeof(h));
    if (h.magic != DGR_STATE_MAGIC || h.version != DGR_STATE_VERSION) {
        return fail(DGR_E_STATE, "not a dgr session state (magic %08x, version %u)", h.magic, h.version);
    }
    const dgr_shard_info & info = engine->info;
    if (h.layer_begin != info.layer_begin || h.layer_end != info.layer_end || h.in_width != info.in_width ||
        h.out_width != info.out_width) {
        return fail(DGR_E_STATE, "saved state is for layers [%d, %d), this shard owns [%d, %d)", h.layer_begin,
                    h.layer_end, info.layer_begin, info.layer_end);
    }
    if (h.payload_size != size - sizeof(h) || h.next_pos < 0 || (uint32_t) h.next_pos > info.n_ctx_per_session) {
        return fail(DGR_E_STATE, "saved state is truncated or inconsistent");
    }
    engine->clear_seq(*slot);
    const size_t n = llama_state_seq_set_data(engine->ctx, buf + sizeof(h), h.payload_size, slot->seq);
    if (n == 0) {
        engine->clear_seq(*slot);
        slot->next_pos = 0;
        slot->rollback_rows = 0;
        return fail(DGR_E_STATE, "llama.cpp refused the saved state; session %llu is now empty",
                    (unsigned long long) session_id);
    }
    slot->next_pos = h.next_pos;
    slot->rollback_rows = 0;
    if (engine->mtp_ctx != nullptr) {
        // the saved state is the owned layers' only: the MTP block's inputs are not in it
        llama_memory_seq_rm(llama_get_memory(engine->mtp_ctx), slot->seq, -1, -1);
        const size_t width = slot->mtp.pending_h.size();
        slot->mtp = mtp_slot{};
        slot->mtp.pending_h.assign(width, 0.0f);
        slot->mtp.ok = h.next_pos == 0;
    }
    return ok();
    DGR_GUARD_END
}

}  // extern "C"

// ---- the vocabulary alone (ABI 6) ----------------------------------------------------------

struct dgr_vocab {
    llama_model * model = nullptr;
    const llama_vocab * vocab = nullptr;
    std::string chat_template;  // empty: none

    ~dgr_vocab() {
        if (model != nullptr) {
            llama_model_free(model);
        }
    }
};

namespace {

bool vocab_has_tokenizer(const dgr_vocab * vocab) {
    return llama_vocab_type(vocab->vocab) != LLAMA_VOCAB_TYPE_NONE;
}

int fail_no_tokenizer() {
    return fail(DGR_E_UNSUPPORTED, "this model has no tokenizer (vocabulary type none): token ids only");
}

}  // namespace

int dgr_vocab_open(const char * model_path, dgr_vocab ** out) {
    if (model_path == nullptr || out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "model_path and out must not be NULL");
    }
    *out = nullptr;
    DGR_GUARD_BEGIN
    init_backend_once();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    g_llama_last_log_error.clear();
    llama_model * model = llama_model_load_from_file(model_path, params);
    if (model == nullptr) {
        return fail(DGR_E_MODEL_LOAD, "cannot load the vocabulary of '%s': %s", model_path,
                    g_llama_last_log_error.empty() ? "llama.cpp refused it" : g_llama_last_log_error.c_str());
    }
    auto holder = std::make_unique<dgr_vocab>();
    holder->model = model;
    holder->vocab = llama_model_get_vocab(model);
    if (holder->vocab == nullptr || llama_vocab_n_tokens(holder->vocab) <= 0) {
        return fail(DGR_E_MODEL_LOAD, "'%s' has no vocabulary", model_path);
    }
    const char * tmpl = llama_model_chat_template(model, nullptr);
    if (tmpl != nullptr) {
        holder->chat_template = tmpl;
    }
    *out = holder.release();
    return ok();
    DGR_GUARD_END
}

void dgr_vocab_free(dgr_vocab * vocab) { delete vocab; }

int dgr_vocab_get_info(const dgr_vocab * vocab, dgr_vocab_info * out) {
    if (vocab == nullptr || out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "vocab and out must not be NULL");
    }
    const llama_vocab * v = vocab->vocab;
    out->n_vocab = llama_vocab_n_tokens(v);
    out->bos = llama_vocab_bos(v);
    out->eos = llama_vocab_eos(v);
    out->eot = llama_vocab_eot(v);
    out->add_bos = llama_vocab_get_add_bos(v) ? 1 : 0;
    out->has_chat_template = vocab->chat_template.empty() ? 0 : 1;
    out->has_tokenizer = vocab_has_tokenizer(vocab) ? 1 : 0;
    return ok();
}

int dgr_vocab_tokenize(const dgr_vocab * vocab, const char * text, int32_t text_len,
                       uint8_t add_special, uint8_t parse_special, int32_t * tokens,
                       int32_t capacity, int32_t * n_tokens) {
    if (vocab == nullptr || n_tokens == nullptr || (text == nullptr && text_len > 0) || text_len < 0 ||
        capacity < 0 || (tokens == nullptr && capacity > 0)) {
        return fail(DGR_E_INVALID_ARGUMENT, "bad arguments to dgr_vocab_tokenize");
    }
    if (!vocab_has_tokenizer(vocab)) {
        return fail_no_tokenizer();
    }
    DGR_GUARD_BEGIN
    const int32_t n = llama_tokenize(vocab->vocab, text == nullptr ? "" : text, text_len, tokens, capacity,
                                     add_special != 0, parse_special != 0);
    if (n == INT32_MIN) {
        return fail(DGR_E_INVALID_ARGUMENT, "text of %d bytes gives too many tokens", text_len);
    }
    if (n < 0) {
        *n_tokens = -n;
        return fail(DGR_E_SHAPE, "the text needs %d tokens, the buffer holds %d", -n, capacity);
    }
    *n_tokens = n;
    return ok();
    DGR_GUARD_END
}

int dgr_vocab_piece(const dgr_vocab * vocab, int32_t token, uint8_t special, char * buf,
                    int32_t capacity, int32_t * n_bytes) {
    if (vocab == nullptr || n_bytes == nullptr || capacity < 0 || (buf == nullptr && capacity > 0)) {
        return fail(DGR_E_INVALID_ARGUMENT, "bad arguments to dgr_vocab_piece");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(vocab->vocab);
    if (token < 0 || token >= n_vocab) {
        return fail(DGR_E_INVALID_ARGUMENT, "token id %d is outside the vocabulary [0, %d)", token, n_vocab);
    }
    if (!vocab_has_tokenizer(vocab)) {
        return fail_no_tokenizer();
    }
    DGR_GUARD_BEGIN
    const int32_t n = llama_token_to_piece(vocab->vocab, token, buf, capacity, 0, special != 0);
    if (n < 0) {
        *n_bytes = -n;
        return fail(DGR_E_SHAPE, "the piece of token %d needs %d bytes, the buffer holds %d", token, -n, capacity);
    }
    *n_bytes = n;
    return ok();
    DGR_GUARD_END
}

int dgr_vocab_is_eog(const dgr_vocab * vocab, int32_t token, uint8_t * out) {
    if (vocab == nullptr || out == nullptr) {
        return fail(DGR_E_INVALID_ARGUMENT, "vocab and out must not be NULL");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(vocab->vocab);
    if (token < 0 || token >= n_vocab) {
        return fail(DGR_E_INVALID_ARGUMENT, "token id %d is outside the vocabulary [0, %d)", token, n_vocab);
    }
    *out = llama_vocab_is_eog(vocab->vocab, token) ? 1 : 0;
    return ok();
}

int dgr_vocab_chat(const dgr_vocab * vocab, const dgr_chat_message * messages, size_t n,
                   uint8_t add_assistant, char * buf, int32_t capacity, int32_t * n_bytes) {
    if (vocab == nullptr || n_bytes == nullptr || (messages == nullptr && n > 0) || capacity < 0 ||
        (buf == nullptr && capacity > 0)) {
        return fail(DGR_E_INVALID_ARGUMENT, "bad arguments to dgr_vocab_chat");
    }
    if (vocab->chat_template.empty()) {
        return fail(DGR_E_UNSUPPORTED, "this model's GGUF has no chat template (tokenizer.chat_template)");
    }
    DGR_GUARD_BEGIN
    std::vector<llama_chat_message> chat(n);
    for (size_t i = 0; i < n; ++i) {
        if (messages[i].role == nullptr || messages[i].content == nullptr) {
            return fail(DGR_E_INVALID_ARGUMENT, "message %zu has no role or no content", i);
        }
        chat[i] = {messages[i].role, messages[i].content};
    }
    const int32_t need = llama_chat_apply_template(vocab->chat_template.c_str(), chat.data(), n,
                                                   add_assistant != 0, buf, capacity);
    if (need < 0) {
        return fail(DGR_E_UNSUPPORTED, "llama.cpp cannot apply this model's chat template");
    }
    *n_bytes = need;
    if (need > capacity) {
        return fail(DGR_E_SHAPE, "the chat needs %d bytes, the buffer holds %d", need, capacity);
    }
    return ok();
    DGR_GUARD_END
}
