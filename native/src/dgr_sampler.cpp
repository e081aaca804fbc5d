// dgr's one sampler (ABI 15): the token a session takes from one row of logits, as a fixed
// function of the logits, the sampling parameters, the token's position, the seed and the
// tokens before it. The algorithm is docs/sampling.md's, step for step; tests/engine/
// test_sampler.py holds this code to a plain reference of that text. Compiled without
// floating-point contraction (cffi_build.py): every operation below is one IEEE double
// operation, in the order written, and exp is the C library's.

#include "dgr_sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <unordered_map>
#include <vector>

namespace {

uint64_t mix(uint64_t z) {  // SplitMix64's step (Steele, Lea, Flood 2014)
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int refuse(char * why, size_t why_size, int status, const char * text) {
    if (why != nullptr && why_size > 0) {
        std::snprintf(why, why_size, "%s", text);
    }
    return status;
}

// candidates most likely first: larger (penalised) logit first, the lower token id on ties
struct more_likely {
    const std::vector<double> * s;
    bool operator()(int32_t a, int32_t b) const {
        const double x = (*s)[(size_t) a];
        const double y = (*s)[(size_t) b];
        return x > y || (x == y && a < b);
    }
};

// the `size` most likely of all tokens, most likely first: one pass keeping the best `size`
// in a heap whose top is the least likely of them (the ranking is a strict total order, so the
// set is unique), then those ranked
std::vector<int32_t> most_likely(const std::vector<double> & s, size_t size) {
    const size_t n = s.size();
    const more_likely order{&s};
    std::vector<int32_t> top;
    if (size >= n) {
        top.resize(n);
        for (size_t i = 0; i < n; ++i) {
            top[i] = (int32_t) i;
        }
    } else {
        top.reserve(size);
        for (size_t i = 0; i < n; ++i) {
            const auto id = (int32_t) i;
            if (top.size() < size) {
                top.push_back(id);
                std::push_heap(top.begin(), top.end(), order);
            } else if (order(id, top.front())) {
                std::pop_heap(top.begin(), top.end(), order);
                top.back() = id;
                std::push_heap(top.begin(), top.end(), order);
            }
        }
    }
    std::sort(top.begin(), top.end(), order);
    return top;
}

}  // namespace

double dgr_sample_uniform(uint64_t seed, uint32_t position) {
    return (double) (mix(mix(seed) ^ (uint64_t) position) >> 11) * 0x1.0p-53;
}

int dgr_sampling_valid(const dgr_sampling * p, char * why, size_t why_size) {
    char text[160];
    if (p == nullptr) {
        return refuse(why, why_size, DGR_E_INVALID_ARGUMENT, "no sampling parameters");
    }
    if (!(std::isfinite(p->temperature) && p->temperature >= 0)) {
        std::snprintf(text, sizeof text, "temperature must be finite and >= 0, got %g", p->temperature);
    } else if (p->top_k < 0) {
        std::snprintf(text, sizeof text, "top_k must be >= 0 (0: all tokens), got %d", p->top_k);
    } else if (!(p->top_p > 0 && p->top_p <= 1)) {
        std::snprintf(text, sizeof text, "top_p must be in (0, 1], got %g", p->top_p);
    } else if (!(p->min_p >= 0 && p->min_p <= 1)) {
        std::snprintf(text, sizeof text, "min_p must be in [0, 1], got %g", p->min_p);
    } else if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2)) {
        std::snprintf(text, sizeof text, "presence_penalty must be in [-2, 2], got %g", p->presence_penalty);
    } else if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2)) {
        std::snprintf(text, sizeof text, "frequency_penalty must be in [-2, 2], got %g", p->frequency_penalty);
    } else if (!(std::isfinite(p->repetition_penalty) && p->repetition_penalty > 0)) {
        std::snprintf(text, sizeof text, "repetition_penalty must be finite and > 0, got %g",
                      p->repetition_penalty);
    } else if (p->penalty_last_n < 0) {
        std::snprintf(text, sizeof text, "penalty_last_n must be >= 0, got %d", p->penalty_last_n);
    } else {
        return DGR_OK;
    }
    return refuse(why, why_size, DGR_E_INVALID_ARGUMENT, text);
}

int dgr_sampling_penalized(const dgr_sampling * p) {
    return p->penalty_last_n > 0 &&
           (p->presence_penalty != 0 || p->frequency_penalty != 0 || p->repetition_penalty != 1);
}

int dgr_sample_row(const dgr_sampling * p, const float * logits, uint32_t n_vocab, uint32_t position,
                   const int32_t * history, uint32_t n_history, int32_t * out_token, char * why, size_t why_size) {
    const int valid = dgr_sampling_valid(p, why, why_size);
    if (valid != DGR_OK) {
        return valid;
    }
    if (logits == nullptr || out_token == nullptr || n_vocab == 0 || n_vocab > (uint32_t) INT32_MAX ||
        (history == nullptr && n_history > 0)) {
        return refuse(why, why_size, DGR_E_INVALID_ARGUMENT, "no logits, no vocabulary or no output");
    }
    const size_t n = n_vocab;
    // the thread's own buffers, kept between calls: a vocabulary-sized allocation a token costs
    // more in fresh pages than the arithmetic
    thread_local std::vector<double> s;
    thread_local std::vector<double> w;
    s.resize(n);
    for (size_t i = 0; i < n; ++i) {
        if (!std::isfinite(logits[i])) {
            char text[96];
            std::snprintf(text, sizeof text, "logit %zu of %zu is not finite", i, n);
            return refuse(why, why_size, DGR_E_NON_FINITE, text);
        }
        s[i] = (double) logits[i];
    }
    // 1. penalties, over the last penalty_last_n tokens before the position
    if (dgr_sampling_penalized(p)) {
        const uint32_t window = std::min<uint32_t>((uint32_t) p->penalty_last_n, n_history);
        std::unordered_map<int32_t, uint32_t> counts;
        for (uint32_t i = n_history - window; i < n_history; ++i) {
            if (history[i] < 0 || (uint32_t) history[i] >= n_vocab) {
                return refuse(why, why_size, DGR_E_INVALID_ARGUMENT, "a history token outside the vocabulary");
            }
            counts[history[i]] += 1;
        }
        for (const auto & [token, count] : counts) {
            double x = s[(size_t) token];
            if (p->repetition_penalty != 1) {
                x = x <= 0 ? x * p->repetition_penalty : x / p->repetition_penalty;
            }
            const double by_count = (double) count * p->frequency_penalty;
            x = x - (by_count + p->presence_penalty);
            s[(size_t) token] = x;
        }
    }
    // 2. greedy at temperature 0: the lowest token id of the largest value
    if (p->temperature == 0) {
        size_t best = 0;
        for (size_t i = 1; i < n; ++i) {
            if (s[i] > s[best]) {
                best = i;
            }
        }
        *out_token = (int32_t) best;
        return DGR_OK;
    }
    // 3. weights: exp((x - largest) / temperature), so the largest weighs exactly 1 and none
    //    overflows at any temperature (a tiny one gives the others 0: greedy in the limit)
    double top = s[0];
    for (size_t i = 1; i < n; ++i) {
        top = std::max(top, s[i]);
    }
    // 4. the kept set: top-k, then top-p, then min-p. `all`: every token is kept (no list);
    //    else `kept` lists them, in ranking order until the draw sorts them by id. Only the
    //    weights of tokens still kept after top-k are ever read: only those are computed.
    bool all = true;
    std::vector<int32_t> kept;
    w.resize(n);
    const auto weigh = [&](size_t i) { w[i] = std::exp((s[i] - top) / p->temperature); };
    if (p->top_k > 0 && (size_t) p->top_k < n) {
        kept = most_likely(s, (size_t) p->top_k);
        all = false;
        for (int32_t i : kept) {
            weigh((size_t) i);
        }
    } else {
        for (size_t i = 0; i < n; ++i) {
            weigh(i);
        }
    }
    if (p->top_p < 1) {
        double total = 0;  // the kept weight, summed in ascending id order
        if (all) {
            for (size_t i = 0; i < n; ++i) {
                total = total + w[i];
            }
        } else {
            std::vector<int32_t> by_id(kept);
            std::sort(by_id.begin(), by_id.end());
            for (int32_t i : by_id) {
                total = total + w[(size_t) i];
            }
        }
        const double need = p->top_p * total;
        const size_t steps[] = {64, 1024, n};
        for (size_t size : steps) {  // the nucleus: the shortest ranking prefix reaching `need`
            std::vector<int32_t> ranked = all ? most_likely(s, size) : kept;
            double cumulative = 0;
            size_t end = 0;
            while (end < ranked.size()) {
                cumulative = cumulative + w[(size_t) ranked[end]];
                end += 1;
                if (cumulative >= need) {
                    break;
                }
            }
            const bool reached = cumulative >= need;
            if (reached || ranked.size() >= (all ? n : kept.size())) {
                ranked.resize(end);  // reached, or rounding kept it under: the whole set
                kept.swap(ranked);
                all = false;
                break;
            }
        }
    }
    if (p->min_p > 0) {
        if (all) {
            for (size_t i = 0; i < n; ++i) {
                if (!(w[i] < p->min_p)) {
                    kept.push_back((int32_t) i);
                }
            }
            all = false;
        } else {
            kept.erase(std::remove_if(kept.begin(), kept.end(),
                                      [&](int32_t i) { return w[(size_t) i] < p->min_p; }),
                       kept.end());
        }
    }
    // 5. the draw: one uniform number of (seed, position), walked over the kept tokens in id order
    const double u = dgr_sample_uniform(p->seed, position);
    int32_t chosen = -1;
    if (all) {
        double sum = 0;
        for (size_t i = 0; i < n; ++i) {
            sum = sum + w[i];
        }
        const double target = u * sum;
        double cumulative = 0;
        for (size_t i = 0; i < n; ++i) {
            cumulative = cumulative + w[i];
            chosen = (int32_t) i;
            if (cumulative > target) {
                break;
            }
        }
    } else {
        std::sort(kept.begin(), kept.end());
        double sum = 0;
        for (int32_t i : kept) {
            sum = sum + w[(size_t) i];
        }
        const double target = u * sum;
        double cumulative = 0;
        for (int32_t i : kept) {
            cumulative = cumulative + w[(size_t) i];
            chosen = i;
            if (cumulative > target) {
                break;
            }
        }
    }
    *out_token = chosen;  // at least the largest is kept: chosen >= 0
    return DGR_OK;
}
