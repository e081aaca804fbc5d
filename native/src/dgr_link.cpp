// dgr_link.cpp - native frame links: one session epoch's frames of a chained route or a ring,
// read, checked, run and sent on by a thread of their own, with no Python on the way (the
// message format and the checks are in dgr_shard.h, "Native frame links").

#include "dgr_shard.h"
#include "dgr_sampler.h"
#include "monocypher.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

// dgr_shard.cpp: records the calling thread's failure (dgr_last_error) and returns status
int dgr_fail_with(int status, const char * message);
// dgr_shard.cpp: the lock every call on the engine holds
std::recursive_mutex & dgr_engine_call_mutex(dgr_engine * engine);

namespace {

// One frame waiting in a co-batching group.
struct batch_wait {
    dgr_forward_item item{};
    bool done = false;
    bool shared = false;     // ran with another session's frame
    uint64_t engine_ns = 0;  // its rows' share of its call's time
};

}  // namespace

struct dgr_link_batch {
    dgr_engine * engine = nullptr;
    uint32_t max_rows = 1;
    std::mutex m;  // guards the rest
    std::condition_variable called;
    std::deque<batch_wait *> queue;
    bool running = false;  // a frame of the queue leads a call now
    uint64_t calls = 0;
    uint64_t frames = 0;

    // Runs w in one of the group's calls: the first frame to find no call running leads calls
    // (holding the engine, it takes from the head of the queue the frames of one call, one per
    // session and within max_rows rows, the head always) until its own frame ran; the others
    // wait for theirs.
    void run(batch_wait * w);
};

void dgr_link_batch::run(batch_wait * w) {
    std::unique_lock<std::mutex> held(m);
    queue.push_back(w);
    while (!w->done) {
        if (running) {
            called.wait(held);
            continue;
        }
        running = true;
        held.unlock();
        std::vector<batch_wait *> call;
        {
            const std::lock_guard<std::recursive_mutex> engine_held(dgr_engine_call_mutex(engine));
            {
                const std::lock_guard<std::mutex> take(m);
                std::deque<batch_wait *> kept;
                uint32_t rows = 0;
                while (!queue.empty()) {
                    batch_wait * next = queue.front();
                    queue.pop_front();
                    bool same_session = false;
                    for (const batch_wait * c : call) {
                        same_session = same_session || c->item.session_id == next->item.session_id;
                    }
                    if (call.empty() || (!same_session && rows + next->item.n_rows <= max_rows)) {
                        call.push_back(next);
                        rows += next->item.n_rows;
                    } else {
                        kept.push_back(next);
                    }
                }
                queue.swap(kept);
            }
            std::vector<dgr_forward_item> items;
            uint32_t rows = 0;
            for (const batch_wait * c : call) {
                items.push_back(c->item);
                rows += c->item.n_rows;
            }
            const auto began = std::chrono::steady_clock::now();
            const int rc = dgr_forward_batch(engine, items.data(), (uint32_t) items.size());
            const uint64_t took = (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
                                      std::chrono::steady_clock::now() - began)
                                      .count();
            for (size_t i = 0; i < call.size(); ++i) {
                call[i]->item = items[i];
                if (rc != DGR_OK) {  // nothing ran: every frame of the call fails with it
                    call[i]->item.status = rc;
                    std::snprintf(call[i]->item.error, sizeof call[i]->item.error, "%s", dgr_last_error());
                }
                call[i]->shared = call.size() > 1;
                call[i]->engine_ns = rows ? took * call[i]->item.n_rows / rows : took;
            }
        }
        held.lock();
        for (batch_wait * c : call) {
            c->done = true;
        }
        calls += 1;
        frames += call.size();
        running = false;
        called.notify_all();
    }
}

namespace {

constexpr size_t kHeader = DGR_LINK_HEADER_BYTES;

struct header {
    uint32_t magic = DGR_LINK_MAGIC;
    uint16_t version = DGR_LINK_VERSION;
    uint16_t kind = 0;
    uint64_t epoch = 0;
    uint32_t step = 0;
    int32_t pos = 0;
    uint32_t n_rows = 0;
    uint32_t width = 0;
    uint32_t until_step = 0;
    uint32_t n_stop = 0;
    uint32_t hop = 0;
    int32_t value = 0;
    uint32_t payload_bytes = 0;
    uint32_t engine_us = 0;  // the engine time of this pass so far, summed over its stages
};
static_assert(sizeof(header) == kHeader, "the header is 56 packed bytes");

uint64_t monotonic_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

// How a read ended.
enum class got { all, closed, timed_out, error };

// Reads exactly n bytes; waits at most timeout_ms in all (-1: no bound).
got read_all(int fd, void * buf, size_t n, int timeout_ms) {
    auto * p = static_cast<uint8_t *>(buf);
    const uint64_t until = timeout_ms < 0 ? 0 : monotonic_ns() + (uint64_t) timeout_ms * 1000000ull;
    while (n > 0) {
        if (timeout_ms >= 0) {
            const uint64_t now = monotonic_ns();
            if (now >= until) {
                return got::timed_out;
            }
            pollfd pfd{fd, POLLIN, 0};
            const int rc = poll(&pfd, 1, (int) ((until - now + 999999) / 1000000));
            if (rc == 0) {
                return got::timed_out;
            }
            if (rc < 0 && errno != EINTR) {
                return got::error;
            }
            if (rc <= 0) {
                continue;
            }
        }
        const ssize_t k = recv(fd, p, n, 0);
        if (k == 0) {
            return got::closed;
        }
        if (k < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno == ECONNRESET ? got::closed : got::error;
        }
        p += k;
        n -= (size_t) k;
    }
    return got::all;
}

// The nonce of a direction's message number: the number (u64 little-endian), then 4 zero bytes.
void nonce_of(uint64_t counter, uint8_t nonce[12]) {
    for (int i = 0; i < 8; ++i) {
        nonce[i] = (uint8_t) (counter >> (8 * i));
    }
    nonce[8] = nonce[9] = nonce[10] = nonce[11] = 0;
}

// ChaCha20-Poly1305 (RFC 8439) in place: Monocypher's IETF construction, one message per context.
void seal(const uint8_t * key, uint64_t counter, const uint8_t * ad, size_t ad_size, uint8_t * text, size_t size,
          uint8_t * tag) {
    uint8_t nonce[12];
    nonce_of(counter, nonce);
    crypto_aead_ctx ctx;
    crypto_aead_init_ietf(&ctx, key, nonce);
    crypto_aead_write(&ctx, text, tag, ad, ad_size, text, size);
    crypto_wipe(&ctx, sizeof ctx);
}

// Verifies the tag, then decrypts in place; false (text untouched) when it does not verify.
bool unseal(const uint8_t * key, uint64_t counter, const uint8_t * ad, size_t ad_size, uint8_t * text, size_t size,
            const uint8_t * tag) {
    uint8_t nonce[12];
    nonce_of(counter, nonce);
    crypto_aead_ctx ctx;
    crypto_aead_init_ietf(&ctx, key, nonce);
    const int rc = crypto_aead_read(&ctx, text, tag, ad, ad_size, text, size);
    crypto_wipe(&ctx, sizeof ctx);
    return rc == 0;
}

constexpr size_t kTag = DGR_LINK_TAG_BYTES;

bool write_all(int fd, const void * buf, size_t n) {
    const auto * p = static_cast<const uint8_t *>(buf);
    while (n > 0) {
        const ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0) {
            if (errno == EINTR) {
                continue;
            }
            return false;
        }
        p += k;
        n -= (size_t) k;
    }
    return true;
}

}  // namespace

struct dgr_link {
    dgr_engine * engine = nullptr;
    dgr_link_params params{};
    dgr_shard_info info{};
    std::thread thread;
    std::atomic<bool> stopping{false};
    std::mutex wake_mutex;  // with `wake`: a frame waiting for its budget wakes when stopped
    std::condition_variable wake;
    // the session's frame budget (params.frames_per_second): a token bucket
    double budget = 0.0;
    uint64_t budget_at = 0;
    // waits until the budget has a frame; false when the link was stopped meanwhile
    bool take_budget();
    uint64_t budget_wait_ns = 0;  // how long the last frame waited for its budget

    std::mutex stats_mutex;  // guards stats (the thread writes, dgr_link_get_stats reads)
    dgr_link_stats stats{};

    // the thread's own buffers
    std::vector<uint8_t> in;
    std::vector<uint8_t> out;
    std::vector<float> result;
    std::vector<int32_t> positions;
    std::vector<int32_t> history;  // a penalised sampler's last stage: the token at each position

    int fds[4] = {-1, -1, -1, -1};
    // sealed links: each descriptor's key (fds' order) and the number of its next message
    bool sealed = false;
    uint8_t keys[4][DGR_LINK_KEY_BYTES] = {};
    uint64_t counters[4] = {0, 0, 0, 0};
    int slot_of(int fd) const {
        for (int i = 0; i < 4; ++i) {
            if (fds[i] == fd) {
                return i;
            }
        }
        return -1;
    }
    // sends `out` (a header and its payload) to fd, sealed on a sealed link
    bool send_out(int fd);

    void run();
    // one frame from fd; false when the link ends
    bool one_frame(int fd);
    // how the link ends, set once by the thread (end) and published as it leaves (publish)
    int outcome_state = DGR_LINK_STATE_RUNNING;
    int outcome_status = DGR_OK;
    uint32_t outcome_hop = 0;
    std::string outcome_error;

    void end(int state, int status, uint32_t failed_hop, const char * fmt, ...);
    void publish();
    void pass_failure(const header & h, const uint8_t * message, size_t n);
    bool send_frame(int fd, const header & h, const void * payload, size_t n);
};

void dgr_link::end(int state, int status, uint32_t failed_hop, const char * fmt, ...) {
    // the outcome is published (and the caller woken) only when the thread leaves run(): a
    // failure is passed on before anyone may shut the link's sockets down
    if (outcome_state != DGR_LINK_STATE_RUNNING) {
        return;
    }
    outcome_state = state;
    outcome_status = status;
    outcome_hop = failed_hop;
    char text[DGR_LINK_MESSAGE_BYTES];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    outcome_error = text;
}

void dgr_link::publish() {
    {
        const std::lock_guard<std::mutex> hold(stats_mutex);
        stats.state = outcome_state == DGR_LINK_STATE_RUNNING ? DGR_LINK_STATE_ENDED : outcome_state;
        stats.status = outcome_status;
        stats.failed_hop = outcome_hop;
        std::snprintf(stats.error, sizeof(stats.error), "%s", outcome_error.c_str());
    }
    if (params.notify_fd >= 0) {
        const uint8_t byte = 1;
        (void) !write(params.notify_fd, &byte, 1);
    }
}

bool dgr_link::send_out(int fd) {
    if (sealed) {
        const int slot = slot_of(fd);
        if (slot < 0) {
            return false;
        }
        const size_t n = out.size() - kHeader;
        out.resize(out.size() + kTag);
        seal(keys[slot], counters[slot]++, out.data(), kHeader, out.data() + kHeader, n, out.data() + kHeader + n);
    }
    if (!write_all(fd, out.data(), out.size())) {
        return false;
    }
    const std::lock_guard<std::mutex> hold(stats_mutex);
    stats.bytes_out += out.size();
    return true;
}

bool dgr_link::send_frame(int fd, const header & h, const void * payload, size_t n) {
    // one buffer, one send: the header and the payload leave together
    out.resize(kHeader + n);
    std::memcpy(out.data(), &h, kHeader);
    if (n > 0) {
        std::memcpy(out.data() + kHeader, payload, n);
    }
    return send_out(fd);
}

// Sends a failure on toward the client (the next stage, or the client's stream on the last).
void dgr_link::pass_failure(const header & h, const uint8_t * message, size_t n) {
    header f{};
    f.kind = DGR_LINK_FAILED;
    f.epoch = params.epoch;
    f.step = h.step;
    f.hop = h.hop;
    f.value = h.value;
    f.payload_bytes = (uint32_t) n;
    (void) send_frame(params.out_fd, f, message, n);
}

bool dgr_link::take_budget() {
    const double rate = params.frames_per_second;
    if (!(rate > 0.0)) {
        return true;
    }
    const double burst = params.burst > 0 ? (double) params.burst : 1.0;
    const uint64_t began = monotonic_ns();
    bool waited = false;
    budget_wait_ns = 0;
    for (;;) {
        const uint64_t now = monotonic_ns();
        budget = std::min(burst, budget + (double) (now - budget_at) / 1e9 * rate);
        budget_at = now;
        if (budget >= 1.0) {
            budget -= 1.0;
            if (waited) {
                budget_wait_ns = now - began;
                const std::lock_guard<std::mutex> hold(stats_mutex);
                stats.throttled += 1;
                stats.throttled_ns += now - began;
            }
            return true;
        }
        waited = true;
        const auto wait = std::chrono::nanoseconds((uint64_t) ((1.0 - budget) / rate * 1e9) + 1);
        std::unique_lock<std::mutex> hold(wake_mutex);
        if (wake.wait_for(hold, wait, [this] { return stopping.load(); })) {
            return false;
        }
    }
}

bool dgr_link::one_frame(int fd) {
    header h{};
    switch (read_all(fd, &h, kHeader, -1)) {
        case got::all:
            break;
        case got::closed:
            if (!stopping.load() && fd == params.in_fd && params.hop > 0) {
                // the stage before ended without DGR_LINK_END: it is lost (said downstream)
                const std::string text = "DGR_E_LINK_LOST: the link from stage " + std::to_string(params.hop - 1) +
                                         " ended without an end message";
                end(DGR_LINK_STATE_FAILED, DGR_E_LINK_LOST, params.hop - 1, "%s", text.c_str());
                header f{};
                f.step = 0;
                f.hop = params.hop - 1;
                f.value = DGR_E_LINK_LOST;
                pass_failure(f, reinterpret_cast<const uint8_t *>(text.data()), text.size());
                return false;
            }
            end(DGR_LINK_STATE_ENDED, DGR_OK, 0, stopping.load() ? "the link was stopped" : "a peer closed its link");
            return false;
        default:
            end(DGR_LINK_STATE_ENDED, DGR_OK, 0, "the link was shut down");
            return false;
    }
    const uint64_t began = monotonic_ns();
    const uint32_t hop = params.hop;
    // a failure is this stage's, but a malformed frame is its sender's: the stage before (on
    // the link from it), a ring's last stage (on the first stage's ring input), else the
    // client's own frames on the first stage, named as this stage
    const uint32_t sender = fd == params.in_fd && hop > 0  ? hop - 1 :
                            fd == params.ring_in_fd        ? params.ring_in_hop :
                                                             hop;
    auto fail_as = [&](uint32_t who, int status, const char * what) {
        end(DGR_LINK_STATE_FAILED, status, who, "%s: %s", dgr_status_name(status), what);
        const std::string text = outcome_error;
        header f = h;
        f.hop = who;
        f.value = status;
        pass_failure(f, reinterpret_cast<const uint8_t *>(text.data()), text.size());
        return false;
    };
    auto refuse = [&](int status, const char * what) { return fail_as(hop, status, what); };
    auto malformed = [&](const char * what) {
        char said[224];
        std::snprintf(said, sizeof said, "stage %u sent a malformed frame: %s", sender, what);
        return fail_as(sender, DGR_E_FRAME, said);
    };
    char why[160];
    if (h.magic != DGR_LINK_MAGIC || h.version != DGR_LINK_VERSION) {
        std::snprintf(why, sizeof why, "not a link message (magic %08x, version %u)", h.magic, h.version);
        return malformed(why);
    }
    const uint32_t width = info.is_first ? 0u : (uint32_t) info.in_width;
    // a sealed link takes a header only once its payload's tag verifies: the payload is bounded
    // by the largest frame this stage takes, then read whole with its tag, then opened
    bool body_read = false;
    if (sealed) {
        const size_t largest = 4 * ((size_t) DGR_LINK_MAX_STOP + params.max_rows + (size_t) params.max_rows * width + hop);
        if (h.payload_bytes > largest && h.payload_bytes >= DGR_LINK_MESSAGE_BYTES) {
            std::snprintf(why, sizeof why, "a payload of %u bytes, over this stage's largest frame (%zu)",
                          h.payload_bytes, largest);
            return malformed(why);
        }
        in.resize((size_t) h.payload_bytes + kTag);
        switch (read_all(fd, in.data(), in.size(), (int) params.body_timeout_ms)) {
            case got::all:
                break;
            case got::timed_out:
                return malformed("the message's payload did not come in time (truncated)");
            default:
                return malformed("the link ended inside a message (truncated)");
        }
        const int slot = slot_of(fd);
        if (slot < 0 || !unseal(keys[slot], counters[slot]++, reinterpret_cast<const uint8_t *>(&h), kHeader,
                                in.data(), h.payload_bytes, in.data() + h.payload_bytes)) {
            return refuse(DGR_E_UNAUTHENTICATED,
                          "a message whose seal does not verify (not from this connection's peer, or "
                          "replayed, reordered or altered)");
        }
        body_read = true;
    }
    if (h.kind == DGR_LINK_FAILED && (fd != params.in_fd || h.hop >= hop || h.value < DGR_E_INVALID_ARGUMENT ||
                                      h.value > DGR_E_UNAVAILABLE)) {
        // only the stage before may say that a stage before it failed, with a status there is
        std::snprintf(why, sizeof why, "a failure (status %d, stage %u) this stage cannot take from its peer",
                      h.value, h.hop);
        return malformed(why);
    }
    if (h.kind == DGR_LINK_FAILED) {
        // a stage before this one failed: passed on as it is (its message, cut to the limit)
        const uint32_t n = h.payload_bytes < DGR_LINK_MESSAGE_BYTES ? h.payload_bytes : DGR_LINK_MESSAGE_BYTES - 1;
        std::vector<uint8_t> message(n);
        if (body_read) {
            std::memcpy(message.data(), in.data(), n);
        } else if (n > 0 && read_all(fd, message.data(), n, (int) params.body_timeout_ms) != got::all) {
            return malformed("a failure message that does not come whole");
        }
        const int status = h.value;
        end(DGR_LINK_STATE_FAILED, status, h.hop, "%.*s", (int) n, reinterpret_cast<const char *>(message.data()));
        pass_failure(h, message.data(), n);
        return false;
    }
    if (h.kind == DGR_LINK_END && h.payload_bytes == 0) {
        header e{};
        e.kind = DGR_LINK_END;
        e.epoch = params.epoch;
        e.hop = hop;
        (void) send_frame(params.out_fd, e, nullptr, 0);  // on toward the client
        end(DGR_LINK_STATE_ENDED, DGR_OK, 0, "ended by an end message");
        return false;
    }
    if (h.kind != DGR_LINK_ROWS) {
        std::snprintf(why, sizeof why, "a message of kind %u where rows were expected", h.kind);
        return malformed(why);
    }
    if (h.epoch != params.epoch) {
        std::snprintf(why, sizeof why, "a frame of epoch %llu on a link of epoch %llu", (unsigned long long) h.epoch,
                      (unsigned long long) params.epoch);
        return refuse(h.epoch < params.epoch ? DGR_E_STALE_EPOCH : DGR_E_UNKNOWN_SESSION, why);
    }
    if (h.n_rows < 1 || h.n_rows > params.max_rows) {
        std::snprintf(why, sizeof why, "%u rows, outside 1..%u", h.n_rows, params.max_rows);
        return malformed(why);
    }
    if (h.width != width) {
        std::snprintf(why, sizeof why, "rows of %u floats where this stage takes %u", h.width, width);
        return malformed(why);
    }
    if (h.n_stop > DGR_LINK_MAX_STOP) {
        std::snprintf(why, sizeof why, "%u stop tokens, over %d", h.n_stop, DGR_LINK_MAX_STOP);
        return malformed(why);
    }
    if (h.pos < 0) {
        return refuse(DGR_E_POSITION, "a negative position");
    }
    // the pass's trace: one u32 per stage it went through (each stage's engine microseconds)
    const size_t n_trace = hop;
    const size_t expected = 4 * ((size_t) h.n_stop + h.n_rows + (size_t) h.n_rows * width + n_trace);
    if (h.payload_bytes != expected) {
        std::snprintf(why, sizeof why, "a payload of %u bytes where the header says %zu", h.payload_bytes, expected);
        return malformed(why);
    }
    if (!body_read) {
        in.resize(expected);
        switch (read_all(fd, in.data(), expected, (int) params.body_timeout_ms)) {
            case got::all:
                break;
            case got::timed_out:
                return malformed("the frame's payload did not come in time (truncated)");
            default:
                return malformed("the link ended inside a frame (truncated)");
        }
    }
    const auto * stop = reinterpret_cast<const int32_t *>(in.data());
    const auto * tokens = stop + h.n_stop;
    const auto * rows = width ? reinterpret_cast<const float *>(tokens + h.n_rows) : nullptr;
    const uint8_t * trace = in.data() + 4 * ((size_t) h.n_stop + h.n_rows + (size_t) h.n_rows * width);
    for (size_t i = 0; rows != nullptr && i < (size_t) h.n_rows * width; ++i) {
        if (!std::isfinite(rows[i])) {
            std::snprintf(why, sizeof why, "a non-finite value in row %zu of the boundary", i / width);
            return malformed(why);
        }
    }
    positions.resize(h.n_rows);
    for (uint32_t i = 0; i < h.n_rows; ++i) {
        positions[i] = h.pos + (int32_t) i;
    }
    if (info.is_last && dgr_sampling_penalized(&params.sampling) != 0 && (size_t) h.pos > history.size()) {
        // a penalised sampler reads every token before its position: none may be missing
        return malformed("a frame after a gap in the session's tokens (a penalised sampler reads them all)");
    }
    if (!take_budget()) {
        end(DGR_LINK_STATE_ENDED, DGR_OK, 0, "the link was stopped");
        return false;
    }
    const size_t out_rows = info.is_last ? 1 : h.n_rows;
    result.resize(out_rows * (size_t) info.out_width);
    uint32_t n_out = 0;
    uint64_t engine_ns = 0;
    bool shared = false;
    if (params.batch != nullptr) {  // co-batched: with the frames that wait for the engine too
        batch_wait w;
        w.item.session_id = params.session_id;
        w.item.epoch = params.epoch;
        w.item.n_rows = h.n_rows;
        w.item.tokens = tokens;
        w.item.rows = rows;
        w.item.row_width = width;
        w.item.positions = positions.data();
        w.item.out = result.data();
        w.item.out_capacity = result.size();
        params.batch->run(&w);
        if (w.item.status != DGR_OK) {
            return refuse(w.item.status, w.item.error);
        }
        n_out = w.item.n_out;
        engine_ns = w.engine_ns;
        shared = w.shared;
    } else {
        const uint64_t engine_began = monotonic_ns();
        const int rc = dgr_session_forward(engine, params.session_id, params.epoch, h.n_rows, tokens, rows, width,
                                           positions.data(), nullptr, result.data(), result.size(), &n_out);
        engine_ns = monotonic_ns() - engine_began;
        if (rc != DGR_OK) {
            return refuse(rc, dgr_last_error());
        }
    }
    // every output value finite (the Python path's output check), and on the last stage the
    // session's token: its sampler's (dgr_sample) at the position after the frame's last row
    bool finite = true;
    for (float x : result) {
        finite = finite && std::isfinite(x);
    }
    if (!finite) {
        return refuse(DGR_E_NON_FINITE, "the engine's output has a non-finite value");
    }
    int32_t best = 0;
    if (info.is_last) {
        const bool penalized = dgr_sampling_penalized(&params.sampling) != 0;
        if (penalized) {  // the positions before this frame's stay; its own replace the rest
            history.resize(std::min(history.size(), (size_t) h.pos));
            history.insert(history.end(), tokens, tokens + h.n_rows);
        }
        char why[DGR_LINK_MESSAGE_BYTES];
        const uint32_t at = (uint32_t) (h.pos + (int32_t) h.n_rows);
        const int rc = dgr_sample_row(&params.sampling, result.data(), (uint32_t) result.size(), at,
                                      penalized ? history.data() : nullptr,
                                      penalized ? (uint32_t) history.size() : 0, &best, why, sizeof why);
        if (rc != DGR_OK) {
            return refuse(rc, why);
        }
    }
    bool sent = true;
    uint64_t onward_at = 0;  // when the frame's output was ready to leave for the route's next step
    uint64_t tokens_answered = 0;
    uint64_t ring_frames = 0;
    if (!info.is_last) {
        header next = h;
        next.hop = hop;
        next.engine_us = h.engine_us + (uint32_t) (engine_ns / 1000);
        next.width = (uint32_t) info.out_width;
        const uint32_t mine = (uint32_t) (engine_ns / 1000);
        const size_t head = 4 * ((size_t) h.n_stop + h.n_rows);
        next.payload_bytes = (uint32_t) (head + 4 * (result.size() + n_trace + 1));
        out.resize(kHeader + next.payload_bytes);
        std::memcpy(out.data(), &next, kHeader);
        std::memcpy(out.data() + kHeader, in.data(), head);
        std::memcpy(out.data() + kHeader + head, result.data(), 4 * result.size());
        std::memcpy(out.data() + kHeader + head + 4 * result.size(), trace, 4 * n_trace);
        std::memcpy(out.data() + kHeader + head + 4 * (result.size() + n_trace), &mine, 4);
        onward_at = monotonic_ns();
        sent = send_out(params.out_fd);
    } else {
        bool stops = h.until_step <= h.step;
        for (uint32_t i = 0; i < h.n_stop; ++i) {
            stops = stops || stop[i] == best;
        }
        if (!stops && params.ring_out_fd >= 0) {
            // the ring's next frame first: the first stage starts on it while the client reads
            header next = h;
            next.hop = hop;
            next.step = h.step + 1;
            next.pos = h.pos + (int32_t) h.n_rows;
            next.n_rows = 1;
            next.width = 0;
            next.engine_us = 0;  // a new pass
            next.value = 2;      // a ring's own frames are decode rows
            next.payload_bytes = 4 * (h.n_stop + 1);
            out.resize(kHeader + next.payload_bytes);
            std::memcpy(out.data(), &next, kHeader);
            std::memcpy(out.data() + kHeader, stop, 4 * (size_t) h.n_stop);
            std::memcpy(out.data() + kHeader + 4 * (size_t) h.n_stop, &best, 4);
            onward_at = monotonic_ns();
            sent = send_out(params.ring_out_fd);
            ring_frames = sent ? 1 : 0;
        }
        header token = h;
        token.kind = DGR_LINK_TOKEN;
        token.hop = hop;
        token.width = 0;
        token.n_stop = 0;
        token.value = best;
        token.engine_us = h.engine_us + (uint32_t) (engine_ns / 1000);
        token.payload_bytes = (uint32_t) (4 * (n_trace + 1));  // the pass's trace, this stage's last
        std::vector<uint8_t> & traced = in;  // the frame's payload is spent: its trace goes on
        const uint32_t mine = (uint32_t) (engine_ns / 1000);
        std::memmove(traced.data(), trace, 4 * n_trace);
        std::memcpy(traced.data() + 4 * n_trace, &mine, 4);
        onward_at = onward_at ? onward_at : monotonic_ns();
        sent = sent && send_frame(params.out_fd, token, traced.data(), 4 * (n_trace + 1));
        tokens_answered = 1;
    }
    {
        const std::lock_guard<std::mutex> hold(stats_mutex);
        stats.frames += 1;
        stats.rows += h.n_rows;
        const size_t kind = h.value >= 0 && h.value <= 3 ? (size_t) h.value : 0;
        stats.kind_frames[kind] += 1;
        stats.kind_rows[kind] += h.n_rows;
        stats.bytes_in += kHeader + expected + (sealed ? kTag : 0);
        stats.engine_ns += engine_ns;
        stats.tokens += tokens_answered;
        stats.co_batched += shared ? 1 : 0;
        stats.ring_frames += ring_frames;
        stats.last_frame_ns = monotonic_ns();
        stats.busy_ns += onward_at - began - budget_wait_ns;  // not the wait for the budget
    }
    if (!sent) {
        end(DGR_LINK_STATE_ENDED, DGR_OK, 0, "the next stage closed its link");
        return false;
    }
    return true;
}

void dgr_link::run() {
    pollfd watch[2] = {{params.in_fd, POLLIN, 0}, {params.ring_in_fd, POLLIN, 0}};
    const nfds_t n = params.ring_in_fd >= 0 ? 2 : 1;
    bool running = true;
    while (running && !stopping.load()) {
        watch[0].revents = watch[1].revents = 0;
        const int rc = poll(watch, n, -1);
        if (rc < 0) {
            if (errno == EINTR) {
                continue;
            }
            end(DGR_LINK_STATE_ENDED, DGR_OK, 0, "poll failed: %s", std::strerror(errno));
            break;
        }
        for (nfds_t i = 0; i < n && running; ++i) {
            running = watch[i].revents == 0 || one_frame(watch[i].fd);
        }
    }
    end(DGR_LINK_STATE_ENDED, DGR_OK, 0, "the link was stopped");
    publish();
}

namespace {

int start_link(dgr_engine * engine, const dgr_link_params * params, const dgr_link_keys * keys, dgr_link ** out) {
    if (engine == nullptr || params == nullptr || out == nullptr) {
        return dgr_fail_with(DGR_E_INVALID_ARGUMENT, "engine, params and out must not be NULL");
    }
    *out = nullptr;
    if (params->in_fd < 0 || params->out_fd < 0 || params->max_rows < 1) {
        return dgr_fail_with(DGR_E_INVALID_ARGUMENT, "a link needs in_fd, out_fd and max_rows >= 1");
    }
    char why[DGR_LINK_MESSAGE_BYTES];
    if (dgr_sampling_valid(&params->sampling, why, sizeof why) != DGR_OK) {
        return dgr_fail_with(DGR_E_INVALID_ARGUMENT, why);
    }
    int32_t next_pos = 0;
    if (int rc = dgr_session_next_pos(engine, params->session_id, params->epoch, &next_pos); rc != DGR_OK) {
        return rc;
    }
    auto * link = new (std::nothrow) dgr_link();
    if (link == nullptr) {
        return dgr_fail_with(DGR_E_INTERNAL, "out of memory for a link");
    }
    link->engine = engine;
    link->params = *params;
    if (int rc = dgr_engine_info(engine, &link->info); rc != DGR_OK) {
        delete link;
        return rc;
    }
    if (link->params.max_rows > link->info.n_batch) {
        link->params.max_rows = link->info.n_batch;
    }
    link->stats.state = DGR_LINK_STATE_RUNNING;
    link->budget = link->params.burst > 0 ? (double) link->params.burst : 1.0;
    link->budget_at = monotonic_ns();
    link->fds[0] = params->in_fd;
    link->fds[1] = params->ring_in_fd;
    link->fds[2] = params->out_fd;
    link->fds[3] = params->ring_out_fd;
    if (keys != nullptr) {
        link->sealed = true;
        std::memcpy(link->keys[0], keys->in, DGR_LINK_KEY_BYTES);
        std::memcpy(link->keys[1], keys->ring_in, DGR_LINK_KEY_BYTES);
        std::memcpy(link->keys[2], keys->out, DGR_LINK_KEY_BYTES);
        std::memcpy(link->keys[3], keys->ring_out, DGR_LINK_KEY_BYTES);
    }
    try {
        link->thread = std::thread([link] { link->run(); });
    } catch (...) {
        delete link;
        return dgr_fail_with(DGR_E_INTERNAL, "could not start the link's thread");
    }
    *out = link;
    return DGR_OK;
}

}  // namespace

extern "C" {

int dgr_link_start(dgr_engine * engine, const dgr_link_params * params, dgr_link ** out) {
    return start_link(engine, params, nullptr, out);
}

int dgr_link_start_sealed(dgr_engine * engine, const dgr_link_params * params, const dgr_link_keys * keys,
                          dgr_link ** out) {
    if (keys == nullptr) {
        return dgr_fail_with(DGR_E_INVALID_ARGUMENT, "a sealed link needs its keys");
    }
    return start_link(engine, params, keys, out);
}

int dgr_link_batch_new(dgr_engine * engine, uint32_t max_rows, dgr_link_batch ** out) {
    if (engine == nullptr || out == nullptr || max_rows < 1) {
        return dgr_fail_with(DGR_E_INVALID_ARGUMENT, "a co-batching group needs an engine and max_rows >= 1");
    }
    auto * batch = new (std::nothrow) dgr_link_batch();
    if (batch == nullptr) {
        return dgr_fail_with(DGR_E_INTERNAL, "out of memory for a co-batching group");
    }
    batch->engine = engine;
    batch->max_rows = max_rows;
    *out = batch;
    return DGR_OK;
}

int dgr_link_batch_get_stats(dgr_link_batch * batch, uint64_t * calls, uint64_t * frames) {
    if (batch == nullptr || calls == nullptr || frames == nullptr) {
        return DGR_E_INVALID_ARGUMENT;
    }
    const std::lock_guard<std::mutex> held(batch->m);
    *calls = batch->calls;
    *frames = batch->frames;
    return DGR_OK;
}

void dgr_link_batch_free(dgr_link_batch * batch) {
    delete batch;
}

int dgr_link_seal(const uint8_t * key, uint64_t counter, const uint8_t * ad, size_t ad_size, uint8_t * text,
                  size_t size, uint8_t * tag) {
    if (key == nullptr || tag == nullptr || (ad == nullptr && ad_size > 0) || (text == nullptr && size > 0)) {
        return dgr_fail_with(DGR_E_INVALID_ARGUMENT, "key, tag, ad and text must not be NULL");
    }
    seal(key, counter, ad, ad_size, text, size, tag);
    return DGR_OK;
}

int dgr_link_unseal(const uint8_t * key, uint64_t counter, const uint8_t * ad, size_t ad_size, uint8_t * text,
                    size_t size, const uint8_t * tag) {
    if (key == nullptr || tag == nullptr || (ad == nullptr && ad_size > 0) || (text == nullptr && size > 0)) {
        return dgr_fail_with(DGR_E_INVALID_ARGUMENT, "key, tag, ad and text must not be NULL");
    }
    if (!unseal(key, counter, ad, ad_size, text, size, tag)) {
        return dgr_fail_with(DGR_E_UNAUTHENTICATED,
                             "a message whose seal does not verify (not from this connection's peer, or "
                             "replayed, reordered or altered)");
    }
    return DGR_OK;
}

int dgr_link_get_stats(dgr_link * link, dgr_link_stats * out) {
    if (link == nullptr || out == nullptr) {
        return DGR_E_INVALID_ARGUMENT;
    }
    const std::lock_guard<std::mutex> hold(link->stats_mutex);
    *out = link->stats;
    return DGR_OK;
}

void dgr_link_stop(dgr_link * link) {
    if (link == nullptr || !link->thread.joinable()) {
        return;
    }
    {
        const std::lock_guard<std::mutex> hold(link->wake_mutex);
        link->stopping.store(true);
    }
    link->wake.notify_all();
    for (int fd : link->fds) {
        if (fd >= 0) {
            shutdown(fd, SHUT_RDWR);  // wakes the thread in poll, recv or send
        }
    }
    link->thread.join();
}

void dgr_link_free(dgr_link * link) {
    if (link == nullptr) {
        return;
    }
    dgr_link_stop(link);
    for (int fd : link->fds) {
        if (fd >= 0) {
            close(fd);
        }
    }
    delete link;
}

}  // extern "C"
