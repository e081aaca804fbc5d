// dgr's one sampler (ABI 15; its own exponential ABI 16): the token a session takes from one
// row of logits, as a fixed function of the logits, the sampling parameters, the token's
// position, the seed and the tokens before it. The algorithm is docs/sampling.md's, step for
// step; tests/engine/test_sampler.py holds this code to a plain reference of that text.
// Compiled without floating-point contraction (cffi_build.py): every operation below is one
// IEEE double operation, in the order written. The exponential is the document's own
// (sample_exp), not the C library's, whose last bit differs between C libraries: a worker's
// tokens must not depend on the system it runs on. Where the CPU has AVX2 the weights are
// computed four at a time by the same operations, so with the same bits.

#include "dgr_sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DGR_SAMPLER_AVX2 1
#endif

namespace {

// docs/sampling.md, "The exponential": exp(y) for y <= 0 by Cody and Waite's reduction and
// the Taylor polynomial of degree 13 (Horner), within about 1 ulp of the true value
constexpr double EXP_FLOOR = -746.0;               // below: 0 (exp(-746) is under half the least subnormal)
constexpr double INV_LN2 = 0x1.71547652b82fep0;    // 1 / ln 2, rounded
constexpr double ROUND_SHIFT = 0x1.8p52;           // adding it rounds to an integer, ties to even
constexpr double LN2_HI = 0x1.62e42fee00000p-1;    // ln 2's leading bits: k * LN2_HI is exact
constexpr double LN2_LO = 0x1.a39ef35793c76p-33;   // ln 2 - LN2_HI, rounded
constexpr double TWO_M1022 = 0x1p-1022;
constexpr double EXP_TERMS[14] = {  // 1/13!, 1/12!, ..., 1/1!, 1/0!: the order Horner reads them
    1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
    1.0 / 40320.0,      1.0 / 5040.0,      1.0 / 720.0,      1.0 / 120.0,     1.0 / 24.0,
    1.0 / 6.0,          1.0 / 2.0,         1.0,              1.0,
};

// 2**(k + 1022) from t = k + ROUND_SHIFT's bits: k + 2045 is its exponent field (k in
// [-1076, 0], so the field is in [969, 2045]; the bits above shift out)
inline double two_to_k_plus_1022(double t) {
    uint64_t bits;
    std::memcpy(&bits, &t, sizeof bits);
    bits = (bits + 2045u) << 52;
    double two;
    std::memcpy(&two, &bits, sizeof two);
    return two;
}

inline double sample_exp(double y) {
    const double x = std::max(y, EXP_FLOOR);
    const double t = x * INV_LN2 + ROUND_SHIFT;
    const double k = t - ROUND_SHIFT;
    const double r = (x - k * LN2_HI) - k * LN2_LO;
    double p = EXP_TERMS[0];
    for (int i = 1; i < 14; ++i) {
        p = p * r + EXP_TERMS[i];
    }
    return (p * two_to_k_plus_1022(t)) * TWO_M1022;
}

// w[i] = sample_exp((s[i] - top) / temperature) for every i
void weigh_scalar(const double * s, double * w, size_t n, double top, double temperature) {
    for (size_t i = 0; i < n; ++i) {
        w[i] = sample_exp((s[i] - top) / temperature);
    }
}

#ifdef DGR_SAMPLER_AVX2
// the same, four at a time: the same IEEE operations in the same order (no FMA), so the bits
__attribute__((target("avx2"))) void weigh_avx2(const double * s, double * w, size_t n, double top,
                                                double temperature) {
    const __m256d v_top = _mm256_set1_pd(top);
    const __m256d v_temperature = _mm256_set1_pd(temperature);
    const __m256d v_floor = _mm256_set1_pd(EXP_FLOOR);
    const __m256d v_inv_ln2 = _mm256_set1_pd(INV_LN2);
    const __m256d v_shift = _mm256_set1_pd(ROUND_SHIFT);
    const __m256d v_ln2_hi = _mm256_set1_pd(LN2_HI);
    const __m256d v_ln2_lo = _mm256_set1_pd(LN2_LO);
    const __m256d v_two_m1022 = _mm256_set1_pd(TWO_M1022);
    const __m256i v_bias = _mm256_set1_epi64x(2045);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m256d y = _mm256_div_pd(_mm256_sub_pd(_mm256_loadu_pd(s + i), v_top), v_temperature);
        const __m256d x = _mm256_max_pd(y, v_floor);  // y is finite: max is std::max
        const __m256d t = _mm256_add_pd(_mm256_mul_pd(x, v_inv_ln2), v_shift);
        const __m256d k = _mm256_sub_pd(t, v_shift);
        const __m256d r = _mm256_sub_pd(_mm256_sub_pd(x, _mm256_mul_pd(k, v_ln2_hi)), _mm256_mul_pd(k, v_ln2_lo));
        __m256d p = _mm256_set1_pd(EXP_TERMS[0]);
        for (int j = 1; j < 14; ++j) {
            p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(EXP_TERMS[j]));
        }
        const __m256i two = _mm256_slli_epi64(_mm256_add_epi64(_mm256_castpd_si256(t), v_bias), 52);
        _mm256_storeu_pd(w + i, _mm256_mul_pd(_mm256_mul_pd(p, _mm256_castsi256_pd(two)), v_two_m1022));
    }
    weigh_scalar(s + i, w + i, n - i, top, temperature);
}
#endif

void weigh_all(const double * s, double * w, size_t n, double top, double temperature) {
#ifdef DGR_SAMPLER_AVX2
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2) {
        weigh_avx2(s, w, n, top, temperature);
        return;
    }
#endif
    weigh_scalar(s, w, n, top, temperature);
}

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
        top.resize(size);
        for (size_t i = 0; i < size; ++i) {
            top[i] = (int32_t) i;
        }
        std::make_heap(top.begin(), top.end(), order);
        // a later token (a larger id) outranks the least likely kept one only by a larger value
        double least = s[(size_t) top.front()];
        for (size_t i = size; i < n; ++i) {
            if (s[i] > least) {
                std::pop_heap(top.begin(), top.end(), order);
                top.back() = (int32_t) i;
                std::push_heap(top.begin(), top.end(), order);
                least = s[(size_t) top.front()];
            }
        }
    }
    std::sort(top.begin(), top.end(), order);
    return top;
}

}  // namespace

double dgr_sample_exp(double y) {
    return sample_exp(std::min(y, 0.0));
}

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
    // one pass without a branch (so the compiler vectorizes it): the values, and whether any
    // is NaN or infinite (all exponent bits set); the first such is then looked for
    uint32_t non_finite = 0;
    for (size_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &logits[i], sizeof bits);
        non_finite |= (uint32_t) ((bits & 0x7f800000u) == 0x7f800000u);
        s[i] = (double) logits[i];
    }
    if (non_finite != 0) {
        size_t i = 0;
        while (std::isfinite(logits[i])) {
            ++i;
        }
        char text[96];
        std::snprintf(text, sizeof text, "logit %zu of %zu is not finite", i, n);
        return refuse(why, why_size, DGR_E_NON_FINITE, text);
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
    // four running maxima, for four times the throughput of one (the largest of finite
    // values is the same whatever the order; a -0.0 against a 0.0 weighs 1 either way)
    double tops[4] = {s[0], s[0], s[0], s[0]};
    size_t i4 = 0;
    for (; i4 + 4 <= n; i4 += 4) {
        for (size_t j = 0; j < 4; ++j) {
            tops[j] = std::max(tops[j], s[i4 + j]);
        }
    }
    for (; i4 < n; ++i4) {
        tops[0] = std::max(tops[0], s[i4]);
    }
    const double top = std::max(std::max(tops[0], tops[1]), std::max(tops[2], tops[3]));
    // 4. the kept set: top-k, then top-p, then min-p. `all`: every token is kept (no list);
    //    else `kept` lists them, in ranking order until the draw sorts them by id. Only the
    //    weights of tokens still kept after top-k are ever read: only those are computed.
    bool all = true;
    std::vector<int32_t> kept;
    w.resize(n);
    if (p->top_k > 0 && (size_t) p->top_k < n) {
        kept = most_likely(s, (size_t) p->top_k);
        all = false;
        for (int32_t i : kept) {
            w[(size_t) i] = sample_exp((s[(size_t) i] - top) / p->temperature);
        }
    } else {
        weigh_all(s.data(), w.data(), n, top, p->temperature);
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
        const size_t steps[] = {64, 1024, 8192, n};
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
