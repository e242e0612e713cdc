// Kairos's CPU kernels for the decoder's small per-layer work, built at first use by engine/cpu_kernels.py
// (g++ -O3 -march=native -fopenmp; plain C ABI, called through ctypes with tensors' data pointers).
//
// - rms_norm:    y = w * cast(x * rsqrt(mean(x^2) + eps)), statistics in fp32 (HF's RMSNorm, one pass per row)
// - rope_write:  RoPE on q and k in place (HF's rotate_half, each op rounded to the activation dtype as torch's
//                eager ops do), then k and v written into the paged cache by slot
// - decode_attn: one query token per request against its context in the paged cache, read block by block
//                through the block table (no gathered copy); scores and accumulation in fp32
// - gemm_packed: linear layers on weights packed once at load, bf16 (AMX tiles or AVX512-BF16 dot products) or
//                fp32 (AVX-512 or AVX2 FMAs), with the bias, a residual add or silu(gate) * up fused in
// - decode_layers: every decoder layer of a decode step in one call, from the kernels above
//
// Element types: float or bf16 (uint16 bit patterns), the same for activations and cache. Parallel loops take
// an explicit thread count and run as OpenMP regions (loaded into a process that has torch, libgomp.so.1
// resolves to torch's own runtime, so they share torch's thread pool), or on Kairos's own thread team, which
// does not wait for a thread that another process keeps off its core (`Team`, `kairos_set_team`).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#ifdef __SSE__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/resource.h>

namespace {

using bf16 = uint16_t;

inline float bf2f(bf16 x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline bf16 f2bf(float f) {  // round to nearest even, as torch does; NaN stays NaN (branch-free: vectorises)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return static_cast<bf16>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// e^x for x <= 0 (softmax after subtracting the max), within ~2 ulp of expf; written so that it vectorises
// (glibc's vector expf is only declared under -ffast-math). Below -87 it returns e^-87 (~1.6e-38): as good as 0
// against the max's term of 1.
inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float f = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;  // ln 2 in two parts
    float p = 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

template <typename T> struct Num;
template <> struct Num<float> {
    static inline float ld(float x) { return x; }
    static inline float st(float x) { return x; }
    static inline float round(float x) { return x; }
};
template <> struct Num<bf16> {
    static inline float ld(bf16 x) { return bf2f(x); }
    static inline bf16 st(float x) { return f2bf(x); }
    static inline float round(float x) { return bf2f(f2bf(x)); }  // what storing an intermediate would give
};

// ---- The kernels' thread team ----------------------------------------------------------------------------------
// A parallel loop over chunks 0..n-1 hands them out from one atomic counter; the calling thread takes chunks too
// and then waits only for the chunks that others have taken. A worker that the OS has not scheduled (because
// another process runs on its core: a served engine shares its cores with the HTTP ingress) takes none, and the
// loop ends without it. OpenMP's regions would wait for it twice: its static share of the work, and the join
// barrier. A decode step runs hundreds of such loops, so one busy core made a 2-thread step as slow as a 1-thread
// one. Workers spin for a while after a loop (the next comes within microseconds in a
// step), then sleep until the next loop's call wakes them.
class Team {
    using Clock = std::chrono::steady_clock;

  public:
    static Team& get() {
        static Team* team = new Team;  // never destroyed: its workers may still be asleep at exit
        return *team;
    }

    // f(i) for i in [0, n) on up to `nthreads` threads (the caller included); returns when every f(i) has returned
    template <typename F>
    void run(int64_t n, int nthreads, F&& f) {
        if (n <= 0) return;
        using Fn = std::remove_reference_t<F>;
        std::unique_lock<std::mutex> one(call_, std::defer_lock);
        if (nthreads <= 1 || n == 1 || !one.try_lock()) {  // a loop already running (another thread, or nested)
            for (int64_t i = 0; i < n; ++i) f(i);
            return;
        }
        if (serial_left_ > 0) {  // the team did not pay lately (`account`)
            --serial_left_;
            for (int64_t i = 0; i < n; ++i) f(i);
            return;
        }
        grow(nthreads - 1);
        fn_ = [](void* c, int64_t i) { (*static_cast<Fn*>(c))(i); };
        ctx_ = const_cast<void*>(static_cast<const void*>(&f));
        helpers_.store(nthreads - 1, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        next_.store(static_cast<uint64_t>(n) << 32, std::memory_order_release);  // publishes fn_, ctx_, done_
        gen_.fetch_add(1, std::memory_order_seq_cst);
        if (sleeping_.load(std::memory_order_seq_cst) > 0) {
            { std::lock_guard<std::mutex> lock(sleep_); }
            wake_.notify_all();
        }
        const auto t0 = Clock::now();
        const int64_t mine = work();
        const auto t1 = Clock::now();
        for (int spins = 1; done_.load(std::memory_order_acquire) < n; ++spins) {
            pause();
            if (spins % 64 == 0) std::this_thread::yield();  // a preempted worker holds a chunk: let it run
        }
        account(t1 - t0, mine, n, Clock::now() - t1);
    }

    // the nice value workers give themselves when they start (they inherit the caller's otherwise)
    void set_worker_nice(int nice) { worker_nice_.store(nice, std::memory_order_relaxed); }

    static constexpr int kInheritNice = 1000;
  private:
    static inline void pause() {
#ifdef __SSE2__
        _mm_pause();
#endif
    }

    // claims chunks of the current loop while there are any: next_ = n << 32 | the next unclaimed chunk
    // returns how many it ran
    int64_t work() {
        uint64_t cur = next_.load(std::memory_order_acquire);
        for (int64_t ran = 0;;) {
            const int64_t n = static_cast<int64_t>(cur >> 32), i = static_cast<int64_t>(cur & 0xffffffffu);
            if (i >= n) return ran;
            if (next_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
                fn_(ctx_, i);  // the loop cannot end (nor fn_ change) before this chunk is done
                done_.fetch_add(1, std::memory_order_release);
                ++ran;
                cur = next_.load(std::memory_order_acquire);
            }
        }
    }

    // Whether the team pays: a loop saves about the time of the chunks others ran (at the caller's own time per
    // chunk) and costs the time the caller then waited for them, long where the OS has preempted a worker holding
    // a chunk because another process wanted its core. Summed over windows of `kWindow` loops (about a decode
    // step), a window that did not gain sends the next `penalty_` loops to the caller alone, twice as many after
    // each further such window up to `kSerialMax`; a window that gained resets the penalty.
    static constexpr int kWindow = 256, kSerialMin = 256, kSerialMax = 8192;

    void account(Clock::duration own, int64_t mine, int64_t n, Clock::duration waited) {
        if (mine > 0) net_ += (own / mine) * (n - mine) - waited;
        if (++loops_ < kWindow) return;
        if (net_.count() <= 0) {
            serial_left_ = penalty_;
            penalty_ = std::min(2 * penalty_, kSerialMax);
        } else {
            penalty_ = kSerialMin;
        }
        loops_ = 0;
        net_ = Clock::duration::zero();
    }

    void grow(int workers) {
        while (static_cast<int>(threads_.size()) < workers) {
            const int index = static_cast<int>(threads_.size());
            threads_.emplace_back([this, index] { loop(index); });
            threads_.back().detach();
        }
    }

    void loop(int index) {
        const int nice = worker_nice_.load(std::memory_order_relaxed);
        if (nice != kInheritNice) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice);
        uint64_t seen = gen_.load(std::memory_order_acquire);
        for (;;) {
            const auto start = Clock::now();
            for (int spins = 1; gen_.load(std::memory_order_acquire) == seen; ++spins) {
                pause();
                if (spins % 64 == 0) std::this_thread::yield();
                if (spins % 256 == 0 && Clock::now() - start > std::chrono::microseconds(200)) {
                    std::unique_lock<std::mutex> lock(sleep_);
                    sleeping_.fetch_add(1, std::memory_order_seq_cst);
                    wake_.wait(lock, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
                    sleeping_.fetch_sub(1, std::memory_order_relaxed);
                }
            }
            seen = gen_.load(std::memory_order_acquire);
            if (index < helpers_.load(std::memory_order_relaxed)) work();
        }
    }

    std::atomic<uint64_t> next_{0};
    std::atomic<int64_t> done_{0};
    std::atomic<uint64_t> gen_{0};  // one per loop: what sleeping workers wait on
    std::atomic<int> helpers_{0};   // workers that may take part in the current loop
    std::atomic<int> sleeping_{0};
    std::atomic<int> worker_nice_{kInheritNice};
    int serial_left_ = 0, penalty_ = kSerialMin, loops_ = 0;  // `account`'s state (under call_)
    Clock::duration net_{};
    void (*fn_)(void*, int64_t) = nullptr;
    void* ctx_ = nullptr;
    std::mutex call_, sleep_;
    std::condition_variable wake_;
    std::vector<std::thread> threads_;
};

// Whether parallel loops run on the team (kairos_set_team) or as OpenMP regions in torch's own thread pool. The
// team pays off where the engine's cores are shared, and wants torch's OpenMP threads passive (OMP_WAIT_POLICY):
// libgomp's workers otherwise spin for milliseconds after each torch op, on the cores the team needs.
std::atomic<bool> use_team{false};

// f(i) for i in [0, n): tasks handed out one at a time, to the team or to OpenMP's threads
template <typename F>
void parallel_for(int64_t n, int nthreads, F&& f) {
    if (nthreads <= 1 || n <= 1) {
        for (int64_t i = 0; i < n; ++i) f(i);
    } else if (use_team.load(std::memory_order_relaxed)) {
        Team::get().run(n, nthreads, f);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) f(i);
    }
}

// f(i) for i in [0, n) in runs of rows, about 4 a thread
template <typename F>
void parallel_rows(int64_t n, int nthreads, F&& f) {
    const int64_t per = std::max<int64_t>(1, (n + 4 * nthreads - 1) / (4 * std::max(1, nthreads)));
    parallel_for((n + per - 1) / per, nthreads, [&](int64_t c) {
        for (int64_t i = c * per, end = std::min(n, (c + 1) * per); i < end; ++i) f(i);
    });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KAIROS_AVX512_BF16 1
// 16 lanes with AVX-512's bf16 conversions (round to nearest even, as torch's)
inline __m512 ld16(const bf16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m256i bf16x16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
inline void st16(bf16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16(v)); }
inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(v)), 16));
}

// rms_norm's row for bf16 with a width that is a multiple of 16
inline void rms_norm_row16(const bf16* xr, const bf16* w, bf16* yr, int64_t d, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) {
        const __m512 v = ld16(xr + j);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(d) + eps));
    for (int64_t j = 0; j < d; j += 16)
        st16(yr + j, _mm512_mul_ps(ld16(w + j), round16(_mm512_mul_ps(ld16(xr + j), r))));
}
#endif

template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* w, T* y, int64_t n, int64_t d, float eps, int nthreads) {
    parallel_rows(n, n * d >= 65536 ? nthreads : 1, [&](int64_t i) {
        const T* xr = x + i * x_stride;
        T* yr = y + i * d;
#ifdef KAIROS_AVX512_BF16
        if (std::is_same<T, bf16>::value && d % 16 == 0) {
            rms_norm_row16(reinterpret_cast<const bf16*>(xr), reinterpret_cast<const bf16*>(w),
                           reinterpret_cast<bf16*>(yr), d, eps);
            return;
        }
#endif
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < d; ++j) {
            float v = Num<T>::ld(xr[j]);
            ss += v * v;
        }
        const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
        for (int64_t j = 0; j < d; ++j)
            yr[j] = Num<T>::st(Num<T>::ld(w[j]) * Num<T>::round(Num<T>::ld(xr[j]) * r));
    });
}

#ifdef KAIROS_AVX512_BF16
// rope_write's rotation of one row's `nrot` heads for bf16 with half a head a multiple of 16: the same roundings
inline void rope_row16(bf16* row, const bf16* c, const bf16* s, int64_t nrot, int64_t hd) {
    const int64_t half = hd / 2;
    const __m512 neg = _mm512_set1_ps(-0.f);
    for (int64_t h = 0; h < nrot; ++h) {
        bf16* v = row + h * hd;
        for (int64_t j = 0; j < half; j += 16) {
            const __m512 x1 = ld16(v + j), x2 = ld16(v + j + half);
            const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(x1, ld16(c + j))),
                                            round16(_mm512_mul_ps(_mm512_xor_ps(x2, neg), ld16(s + j))));
            const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(x2, ld16(c + j + half))),
                                            round16(_mm512_mul_ps(x1, ld16(s + j + half))));
            st16(v + j, lo);
            st16(v + j + half, hi);
        }
    }
}
#endif

template <typename T>
void rope_write(T* qkv, int64_t row_stride, const T* cos, const T* sin, const int64_t* pos, const int64_t* slots,
                T* kc, T* vc, int64_t n, int64_t nh, int64_t nkv, int64_t hd, int nthreads) {
    const int64_t half = hd / 2, nrot = nh + nkv;
    parallel_rows(n, n >= 16 ? nthreads : 1, [&](int64_t i) {
        T* row = qkv + i * row_stride;
        const T* c = cos + pos[i] * hd;
        const T* s = sin + pos[i] * hd;
        float tmp[1024];  // head_dim <= 1024 (checked by the caller)
#ifdef KAIROS_AVX512_BF16
        if (std::is_same<T, bf16>::value && half % 16 == 0) {
            rope_row16(reinterpret_cast<bf16*>(row), reinterpret_cast<const bf16*>(c),
                       reinterpret_cast<const bf16*>(s), nrot, hd);
        } else
#endif
        for (int64_t h = 0; h < nrot; ++h) {
            T* v = row + h * hd;
            // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): two halves, so that each loop vectorises
#pragma omp simd
            for (int64_t j = 0; j < half; ++j)
                tmp[j] = Num<T>::round(Num<T>::ld(v[j]) * Num<T>::ld(c[j])) +
                         Num<T>::round(-Num<T>::ld(v[j + half]) * Num<T>::ld(s[j]));
#pragma omp simd
            for (int64_t j = half; j < hd; ++j)
                tmp[j] = Num<T>::round(Num<T>::ld(v[j]) * Num<T>::ld(c[j])) +
                         Num<T>::round(Num<T>::ld(v[j - half]) * Num<T>::ld(s[j]));
            for (int64_t j = 0; j < hd; ++j) v[j] = Num<T>::st(tmp[j]);
        }
        const int64_t kvw = nkv * hd;
        std::memcpy(kc + slots[i] * kvw, row + nh * hd, kvw * sizeof(T));
        std::memcpy(vc + slots[i] * kvw, row + nrot * hd, kvw * sizeof(T));
    });
}

// The next request's K and V rows (every head of a token, `row_bytes` each), asked for into L2 `per` rows at a time
// while the current request computes (decode_attn's runs of requests), so that memory serves the next context while
// the core does this one's arithmetic, instead of one stall per context.
struct AskNext {
    const char* k = nullptr;
    const char* v = nullptr;
    const int32_t* bt = nullptr;  // the next request's block table (nullptr: no next request)
    int64_t L = 0, t = 0, bs = 1, row_bytes = 0, per = 0;
    void ask() { ask(per); }
    void ask(int64_t rows) {
#ifdef __SSE__
        for (const int64_t e = bt == nullptr ? t : std::min(L, t + rows); t < e; ++t) {
            const int64_t at = (static_cast<int64_t>(bt[t / bs]) * bs + t % bs) * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) {
                _mm_prefetch(k + at + b, _MM_HINT_T1);
                _mm_prefetch(v + at + b, _MM_HINT_T1);
            }
        }
#else
        (void)rows;
#endif
    }
};

// One (request, KV head) task: the G query heads that share the KV head score every context row as it is read,
// then accumulate the V rows. HD is a compile-time head size (64, 128), or 0 for any other (runtime `hd`).
template <typename T, int HD>
void attend_one(const T* qr, const T* kc, const T* vc, const int64_t* off, int64_t L, int64_t G, int64_t hd_rt,
                float scale, T* o, float* qf, float* s, float* acc, float* kv) {
    const int64_t hd = HD ? HD : hd_rt;
    for (int64_t j = 0; j < G * hd; ++j) qf[j] = Num<T>::ld(qr[j]) * scale;
    for (int64_t t = 0; t < L; ++t) {
        const T* kr = kc + off[t];
#pragma omp simd
        for (int64_t j = 0; j < hd; ++j) kv[j] = Num<T>::ld(kr[j]);
        for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf + g * hd;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < hd; ++j) dot = std::fma(qg[j], kv[j], dot);
            s[g * L + t] = dot;
        }
    }
    float inv[64];
    for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
        float tot = 0.f;
#pragma omp simd reduction(+ : tot)
        for (int64_t t = 0; t < L; ++t) {
            sg[t] = exp_nonpos(sg[t] - m);
            tot += sg[t];
        }
        inv[g] = 1.f / tot;
    }
    for (int64_t j = 0; j < G * hd; ++j) acc[j] = 0.f;
    for (int64_t t = 0; t < L; ++t) {
        const T* vr = vc + off[t];
#pragma omp simd
        for (int64_t j = 0; j < hd; ++j) kv[j] = Num<T>::ld(vr[j]);
        for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * L + t];
            float* ag = acc + g * hd;
#pragma omp simd
            for (int64_t j = 0; j < hd; ++j) ag[j] = std::fma(p, kv[j], ag[j]);
        }
    }
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < hd; ++j) o[g * hd + j] = Num<T>::st(acc[g * hd + j] * inv[g]);
}

#ifdef __AVX2__
// AVX2 / AVX-512 path for a head size of 64: the G dot products of 8 context rows are summed across lanes
// together (hadd transpose) instead of one horizontal reduction per dot.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 sum_each8(const __m256* v) {  // lane j = the sum of v[j]'s 8 lanes
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline __m256i bf16_bits8(__m256 v) {  // f2bf's round to nearest even, 8 lanes (NaN payloads aside), as int32
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
}
inline __m256 round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }
inline void store8(bf16* p, __m256 v) {
    const __m256i r = bf16_bits8(v);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// The row-wide arithmetic of attend_one_vec over one vector type: 8 lanes (AVX2) or 16 (AVX-512).
struct Vec8 {
    using V = __m256;
    static constexpr int W = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static V load(const bf16* p) { return load8(p); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static V floor(V a) { return _mm256_floor_ps(a); }
    static V times_pow2(V p, V n) {  // p * 2^n for integral n in the exponent's range
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V div(V a, V b) { return _mm256_div_ps(a, b); }
    static V neg_abs(V a) { return _mm256_or_ps(a, _mm256_set1_ps(-0.f)); }  // -|a|
    static V where_neg(V m, V a, V b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(m, zero(), _CMP_LT_OQ)); }
    static __m256 to8(V a) { return a; }  // a vector whose 8 lanes sum to a's
    template <typename T> static void store(T* p, V v) { store8(p, v); }
};

#ifdef __AVX512F__
struct Vec16 {
    using V = __m512;
    static constexpr int W = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static V load(const bf16* p) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
    static V times_pow2(V p, V n) {
        const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
        return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V div(V a, V b) { return _mm512_div_ps(a, b); }
    static V neg_abs(V a) { return _mm512_or_ps(a, _mm512_set1_ps(-0.f)); }
    static V where_neg(V m, V a, V b) {  // a where m < 0, else b
        return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, zero(), _CMP_LT_OQ), b, a);
    }
    static __m256 to8(V a) {
        return _mm256_add_ps(_mm512_castps512_ps256(a),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    }
    template <typename T> static void store(T* p, V v) {
        store8(p, _mm512_castps512_ps256(v));
        store8(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
};
using VecWide = Vec16;
#else
using VecWide = Vec8;
#endif

// exp_nonpos over a vector's lanes (the same range reduction and polynomial)
template <typename Vec>
inline typename Vec::V exp_nonpos_v(typename Vec::V x) {
    using V = typename Vec::V;
    x = Vec::max(x, Vec::set1(-87.f));
    const V n = Vec::floor(Vec::add(Vec::mul(x, Vec::set1(1.44269504088896341f)), Vec::set1(0.5f)));
    V f = Vec::sub(x, Vec::mul(n, Vec::set1(0.693145751953125f)));
    f = Vec::sub(f, Vec::mul(n, Vec::set1(1.428606765330187045e-06f)));
    V p = Vec::set1(1.f / 5040.f);
    const float c[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    for (float k : c) p = Vec::fmadd(p, f, Vec::set1(k));
    return Vec::times_pow2(p, n);
}

// silu over a vector's lanes, as silu() below: g * sigmoid(g), from e^-|g| only
template <typename Vec>
inline typename Vec::V silu_v(typename Vec::V g) {
    const typename Vec::V e = exp_nonpos_v<Vec>(Vec::neg_abs(g)), one = Vec::set1(1.f);
    return Vec::mul(g, Vec::div(Vec::where_neg(g, e, one), Vec::add(one, e)));
}

// While an attention pass scores context rows [t0, t0 + 8): ask for this head's K row (into L1) and V row (into L2)
// of the rows kAhead further on, `bytes` each, so that memory serves a steady stream instead of one miss at a time.
constexpr int64_t kAhead = 16;
template <typename T>
inline void ask_ahead(const T* kc, const T* vc, const int64_t* off, int64_t t0, int64_t L, int64_t bytes) {
#ifdef __SSE__
    for (int64_t t = t0 + kAhead, e = std::min(L, t0 + kAhead + 8); t < e; ++t)
        for (int64_t b = 0; b < bytes; b += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(kc + off[t]) + b, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vc + off[t]) + b, _MM_HINT_T1);
        }
#else
    (void)kc, (void)vc, (void)off, (void)t0, (void)L, (void)bytes;
#endif
}

// The maximum of s[0, n) (n a multiple of 8) in every lane; a NaN score is skipped.
inline __m256 max_each8(const float* s, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 8) mv = _mm256_max_ps(_mm256_loadu_ps(s + t), mv);
    mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, _MM_SHUFFLE(2, 3, 0, 1)));
}

// attend_one_vec's output for GN query heads (o: the first one's row; p: their probabilities, row stride L8), columns
// [c0, c0 + kAttnVecs) vectors of each 64: sum over t of p[g][t] x V row t, in t order, times inv[g]
constexpr int kAttnVecs = 4;
template <typename T, typename Vec, int GN>
inline void attend_v_block(const T* vc, const int64_t* off, int64_t L, const float* p, int64_t L8, const float* inv,
                           int c0, T* o, AskNext* next) {
    using V = typename Vec::V;
    constexpr int CB = 64 / Vec::W < kAttnVecs ? 64 / Vec::W : kAttnVecs;
    V acc[GN][CB];
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < CB; ++c) acc[g][c] = Vec::zero();
    for (int64_t t = 0; t < L; ++t) {  // GN broadcasts, then one V vector at a time: GN x CB + GN + 1 registers
        if (next != nullptr && t % 2 == 0) next->ask();
        const T* vr = vc + off[t] + c0 * Vec::W;
        V pg[GN];
        for (int g = 0; g < GN; ++g) pg[g] = Vec::set1(p[g * L8 + t]);
        for (int c = 0; c < CB; ++c) {
            const V v = Vec::load(vr + c * Vec::W);
            for (int g = 0; g < GN; ++g) acc[g][c] = Vec::fmadd(pg[g], v, acc[g][c]);
        }
    }
    for (int g = 0; g < GN; ++g) {
        const V iv = Vec::set1(inv[g]);
        for (int c = 0; c < CB; ++c)
            Vec::template store<T>(o + g * 64 + (c0 + c) * Vec::W, Vec::mul(acc[g][c], iv));
    }
}

template <typename T, typename Vec>
void attend_one_vec(const T* qr, const T* kc, const T* vc, const int64_t* off, int64_t L, int64_t G, float scale,
                    T* o, float* s, AskNext& next) {
    using V = typename Vec::V;
    constexpr int C = 64 / Vec::W;  // vectors per 64-float row
    V q[8][C];  // G <= 8 (checked by the caller)
    const V sc = Vec::set1(scale);
    for (int64_t g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) q[g][c] = Vec::mul(Vec::load(qr + g * 64 + c * Vec::W), sc);
    const int64_t L8 = (L + 7) / 8 * 8;
    for (int64_t t0 = 0; t0 < L8; t0 += 8) {
        ask_ahead(kc, vc, off, t0, L, 64 * static_cast<int64_t>(sizeof(T)));
        next.ask();
        __m256 part[8][8];  // [g][row within the 8], each summing to that row's score
        for (int tt = 0; tt < 8; ++tt) {
            const int64_t t = t0 + tt;
            if (t >= L) {
                for (int64_t g = 0; g < G; ++g) part[g][tt] = _mm256_setzero_ps();
                continue;
            }
            const T* kr = kc + off[t];
            V k[C];
            for (int c = 0; c < C; ++c) k[c] = Vec::load(kr + c * Vec::W);
            for (int64_t g = 0; g < G; ++g) {
                V a0 = Vec::mul(q[g][0], k[0]), a1 = Vec::mul(q[g][1], k[1]);
                for (int c = 2; c < C; c += 2) {
                    a0 = Vec::fmadd(q[g][c], k[c], a0);
                    a1 = Vec::fmadd(q[g][c + 1], k[c + 1], a1);
                }
                part[g][tt] = Vec::to8(Vec::add(a0, a1));
            }
        }
        for (int64_t g = 0; g < G; ++g) _mm256_storeu_ps(s + g * L8 + t0, sum_each8(part[g]));
    }
    float inv[8];
    for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * L8;
        for (int64_t t = L; t < L8; ++t) sg[t] = -INFINITY;  // padding rows weigh 0
        const __m256 mv = max_each8(sg, L8);
        __m256 tot = _mm256_setzero_ps();
        for (int64_t t = 0; t < L8; t += 8) {
            const __m256 e = exp_nonpos_v<Vec8>(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
            const __m256 keep = _mm256_cmp_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m256 ev = _mm256_and_ps(e, keep);
            _mm256_storeu_ps(sg + t, ev);
            tot = _mm256_add_ps(tot, ev);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, tot);
        float total = 0.f;
        for (float v : lanes) total += v;
        inv[g] = 1.f / total;
    }
    // the weighted sum of the V rows, in blocks of heads x columns whose sums fit the registers (AVX2's 16: 3 heads x
    // 32 columns; all G x 64 would spill, each row's sums then going through memory)
    constexpr int GB = Vec::W == 8 ? 3 : 6;
    for (int c0 = 0; c0 < C; c0 += kAttnVecs)
        for (int64_t g0 = 0; g0 < G; g0 += GB) {
            AskNext* asks = c0 + g0 == 0 ? &next : nullptr;  // the first block asks as it goes
            const float* p = s + g0 * L8;
            T* og = o + g0 * 64;
            switch (std::min<int64_t>(GB, G - g0)) {
                case 1: attend_v_block<T, Vec, 1>(vc, off, L, p, L8, inv + g0, c0, og, asks); break;
                case 2: attend_v_block<T, Vec, 2>(vc, off, L, p, L8, inv + g0, c0, og, asks); break;
                case 3: attend_v_block<T, Vec, 3>(vc, off, L, p, L8, inv + g0, c0, og, asks); break;
                case 4: attend_v_block<T, Vec, 4>(vc, off, L, p, L8, inv + g0, c0, og, asks); break;
                case 5: attend_v_block<T, Vec, 5>(vc, off, L, p, L8, inv + g0, c0, og, asks); break;
                default: attend_v_block<T, Vec, 6>(vc, off, L, p, L8, inv + g0, c0, og, asks); break;
            }
        }
}
#endif

#ifdef KAIROS_AVX512_BF16
// bf16 with AVX-512's bf16 dot product, head sizes 64 and 128 (HD): the scores q.k from the bf16 pairs of q and of
// each K row as they are (no conversion), and the V rows two at a time: rows t and t+1 interleaved element by element
// make bf16 pairs that one dot product weighs by the pair (p_t, p_t+1). The probabilities are normalised and rounded
// to bf16 first, as HF's eager attention rounds softmax's output to the activations' dtype before its matmul with V.
// Query heads go in groups of GN (a compile-time count, so that the group's accumulators live in registers); each
// group reads the context's K and V rows again (from cache). s: G * (L + 8) floats; p16: G * (L + 8) bf16.

// The scores of GN query heads (qr: the first one's row) against context rows [0, L8), scaled, into s (row stride L8).
template <int HD, int GN>
inline void dp_scores(const bf16* qr, const bf16* kc, const bf16* vc, const int64_t* off, int64_t L, int64_t L8,
                      bool ask_rows, float scale, float* s, AskNext& next) {
    constexpr int NV = HD / 32;  // 512-bit vectors of bf16 per head row
    const __m256 sc = _mm256_set1_ps(scale);
    __m512bh q[GN][NV];
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < NV; ++c) q[g][c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qr + g * HD + c * 32));
    for (int64_t t0 = 0; t0 < L8; t0 += 8) {
        if (ask_rows) ask_ahead(kc, vc, off, t0, L, HD * 2);
        next.ask();
        __m256 part[GN][8];
        for (int tt = 0; tt < 8; ++tt) {
            const int64_t t = t0 + tt;
            if (t >= L) {
                for (int g = 0; g < GN; ++g) part[g][tt] = _mm256_setzero_ps();
                continue;
            }
            const bf16* kr = kc + off[t];
            __m512bh k[NV];
            for (int c = 0; c < NV; ++c) k[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kr + c * 32));
            for (int g = 0; g < GN; ++g) {
                __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], k[0]);
                for (int c = 1; c < NV; ++c) a = _mm512_dpbf16_ps(a, q[g][c], k[c]);
                part[g][tt] = Vec16::to8(a);
            }
        }
        for (int g = 0; g < GN; ++g) _mm256_storeu_ps(s + g * L8 + t0, _mm256_mul_ps(sum_each8(part[g]), sc));
    }
}

// o (GN heads of HD) = the bf16 probabilities p16 (GN rows of stride LP, zero past L) x V's context rows.
template <int HD, int GN>
inline void dp_values(const bf16* vc, const int64_t* off, int64_t L, const bf16* p16, int64_t LP, bf16* o,
                      AskNext& next) {
    constexpr int NV = HD / 32;
    // 128-bit lane j of unpacklo(a, b) holds the pairs of elements 8j..8j+3, unpackhi's those of 8j+4..8j+7: the
    // accumulators' lanes go back to element order through these two permutations
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512 lo[GN][NV], hi[GN][NV];
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < NV; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 2) {
        next.ask();
        const bf16* v0 = vc + off[t];
        const bf16* v1 = t + 1 < L ? vc + off[t + 1] : nullptr;  // past an odd L: a zero row, never a read
        __m512bh plo[NV], phi[NV];
        for (int c = 0; c < NV; ++c) {
            const __m512i a = _mm512_loadu_si512(v0 + c * 32);
            const __m512i b = v1 != nullptr ? _mm512_loadu_si512(v1 + c * 32) : _mm512_setzero_si512();
            plo[c] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
            phi[c] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
        }
        for (int g = 0; g < GN; ++g) {
            int32_t pair;
            std::memcpy(&pair, p16 + g * LP + t, sizeof(pair));
            const __m512bh pv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
            for (int c = 0; c < NV; ++c) {
                lo[g][c] = _mm512_dpbf16_ps(lo[g][c], plo[c], pv);
                hi[g][c] = _mm512_dpbf16_ps(hi[g][c], phi[c], pv);
            }
        }
    }
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < NV; ++c) {
            bf16* oc = o + g * HD + c * 32;
            st16(oc, _mm512_permutex2var_ps(lo[g][c], first, hi[g][c]));
            st16(oc + 16, _mm512_permutex2var_ps(lo[g][c], second, hi[g][c]));
        }
}

template <int HD>
void attend_one_dp(const bf16* qr, const bf16* kc, const bf16* vc, const int64_t* off, int64_t L, int64_t G,
                   float scale, bf16* o, float* s, bf16* p16, AskNext& next) {
    constexpr int GB = 12 / (HD / 32);   // heads per group: 2 * GB * NV accumulators in the V pass
    const int64_t L8 = (L + 7) / 8 * 8;  // score rows, padded
    const int64_t LP = L8 + 2;           // p16 row length: even, with room for the pair past an odd L
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const bf16* qg = qr + g0 * HD;
        float* sg = s + g0 * L8;
        switch (std::min<int64_t>(GB, G - g0)) {
#define KAIROS_SCORES(GN) \
    case GN: if constexpr (GN <= GB) dp_scores<HD, GN>(qg, kc, vc, off, L, L8, g0 == 0, scale, sg, next); break;
            KAIROS_SCORES(1) KAIROS_SCORES(2) KAIROS_SCORES(3) KAIROS_SCORES(4) KAIROS_SCORES(5) KAIROS_SCORES(6)
#undef KAIROS_SCORES
            default: break;
        }
    }
    for (int64_t g = 0; g < G; ++g) {  // softmax, normalised, rounded to bf16
        float* sg = s + g * L8;
        for (int64_t t = L; t < L8; ++t) sg[t] = -INFINITY;  // padding rows weigh 0
        const __m256 mv = max_each8(sg, L8);
        __m256 tot = _mm256_setzero_ps();
        for (int64_t t = 0; t < L8; t += 8) {
            const __m256 x = _mm256_loadu_ps(sg + t);
            const __m256 e = _mm256_and_ps(exp_nonpos_v<Vec8>(_mm256_sub_ps(x, mv)),
                                           _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
            _mm256_storeu_ps(sg + t, e);
            tot = _mm256_add_ps(tot, e);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, tot);
        float total = 0.f;
        for (float v : lanes) total += v;
        const __m256 inv = _mm256_set1_ps(1.f / total);
        bf16* pg = p16 + g * LP;
        for (int64_t t = 0; t < L8; t += 8) store8(pg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), inv));
        pg[L8] = pg[L8 + 1] = 0;
    }
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const bf16* pg = p16 + g0 * LP;
        bf16* og = o + g0 * HD;
        switch (std::min<int64_t>(GB, G - g0)) {
#define KAIROS_VALUES(GN) \
    case GN: if constexpr (GN <= GB) dp_values<HD, GN>(vc, off, L, pg, LP, og, next); break;
            KAIROS_VALUES(1) KAIROS_VALUES(2) KAIROS_VALUES(3) KAIROS_VALUES(4) KAIROS_VALUES(5) KAIROS_VALUES(6)
#undef KAIROS_VALUES
            default: break;
        }
    }
}
#endif

template <typename T>
void decode_attn(const T* q, int64_t q_stride, const T* kc, const T* vc, const int32_t* tables, int64_t max_blocks,
                 const int32_t* ctx, T* out, int64_t n, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float scale,
                 int nthreads) {
    const int64_t G = nh / nkv;  // query heads per KV head: they share every K/V row read (G <= 64)
    const int64_t row = nkv * hd;
    // With enough requests to share out, a task is a run of requests, each with all its KV heads: each K/V row (all
    // heads side by side) then comes from memory once, and the heads after the first read it from cache, while the
    // next request's rows are asked for (AskNext). With fewer requests than 2 per thread, a task is one (request,
    // KV head).
    const bool whole = n >= 2 * nthreads;
    const int64_t run = whole ? std::max<int64_t>(1, (n + 2 * nthreads - 1) / (2 * nthreads)) : 1;  // ~2 a thread
    const int64_t tasks = whole ? (n + run - 1) / run : n * nkv;
    parallel_for(tasks, nthreads, [&](int64_t task) {
        thread_local std::vector<float> qf, acc, kv, s;  // scratch: each thread's, kept between calls
        thread_local std::vector<bf16> p16;
        thread_local std::vector<int64_t> off;
        if (static_cast<int64_t>(qf.size()) < G * hd) qf.resize(G * hd), acc.resize(G * hd);
        if (static_cast<int64_t>(kv.size()) < hd) kv.resize(hd);
        const int64_t i0 = whole ? task * run : task / nkv, i1 = whole ? std::min(n, i0 + run) : i0 + 1;
        const int64_t h0 = whole ? 0 : task % nkv, h1 = whole ? nkv : h0 + 1;
        AskNext next;  // request i + 1's rows, asked for while request i computes
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t L = ctx[i];
            if (static_cast<int64_t>(s.size()) < G * (L + 8)) s.resize(G * (L + 8));
            const int32_t* bt = tables + i * max_blocks;
            // each context row's offset in the cache (in elements, all heads of a token), once for the task's heads
            if (static_cast<int64_t>(off.size()) < L) off.resize(L);
            for (int64_t b = 0, t = 0; t < L; ++b)
                for (int64_t j = 0, at = static_cast<int64_t>(bt[b]) * bs * row; j < bs && t < L; ++j, ++t, at += row)
                    off[t] = at;
            const int64_t asked = next.bt == bt ? next.t : 0;  // rows the previous request asked for
#ifdef __SSE__
            // the context's blocks sit anywhere in the cache, where the hardware prefetcher cannot follow: ask for
            // the rows not yet asked for up front (all heads of a token when the task has them all, else its head's
            // slice), at most 128 KiB of them, so that their reads overlap instead of stalling block by block
            {
                const int64_t skip = h0 * hd;
                const int64_t span = (h1 - h0) * hd * static_cast<int64_t>(sizeof(T));
                const int64_t upto = std::min<int64_t>(L, 128 * 1024 / span);
                for (int64_t t = asked; t < upto; ++t) {
                    const char* kr = reinterpret_cast<const char*>(kc + off[t] + skip);
                    const char* vr = reinterpret_cast<const char*>(vc + off[t] + skip);
                    for (int64_t b = 0; b < span; b += 64) {
                        _mm_prefetch(kr + b, _MM_HINT_T1);
                        _mm_prefetch(vr + b, _MM_HINT_T1);
                    }
                }
            }
#endif
            next = AskNext{};
            if (i + 1 < i1) {  // the next request's rows, spread over this one's passes: about nkv x (L/8 + L/2) asks
                next.k = reinterpret_cast<const char*>(kc);
                next.v = reinterpret_cast<const char*>(vc);
                next.bt = bt + max_blocks;
                next.L = ctx[i + 1], next.bs = bs, next.row_bytes = row * static_cast<int64_t>(sizeof(T));
                const int64_t asks = nkv * ((L + 7) / 8 + (L + 1) / 2);
                next.per = (next.L + asks - 1) / std::max<int64_t>(1, asks);
            }
            for (int64_t h = h0; h < h1; ++h) {
                const T* qr = q + i * q_stride + h * G * hd;
                T* o = out + (i * nh + h * G) * hd;
                const T* k0 = kc + h * hd;
                const T* v0 = vc + h * hd;
#ifdef KAIROS_AVX512_BF16
                if constexpr (std::is_same_v<T, bf16>) {
                    if (hd == 64 || hd == 128) {
                        if (static_cast<int64_t>(p16.size()) < G * (L + 10)) p16.resize(G * (L + 10));
                        if (hd == 64)
                            attend_one_dp<64>(qr, k0, v0, off.data(), L, G, scale, o, s.data(), p16.data(), next);
                        else
                            attend_one_dp<128>(qr, k0, v0, off.data(), L, G, scale, o, s.data(), p16.data(), next);
                        continue;
                    }
                }
#endif
                // the next request's rows asked for by the end of this head: its share of them
                const int64_t share = (next.L * (h - h0 + 1) + (h1 - h0) - 1) / (h1 - h0);
#ifdef __AVX2__
                if (hd == 64 && G <= 8) {  // asks as it goes (every 8 rows scored, every 2 weighed), then the rest
                    attend_one_vec<T, VecWide>(qr, k0, v0, off.data(), L, G, scale, o, s.data(), next);
                    next.ask(share - next.t);
                    continue;
                }
#endif
                next.ask(share - next.t);  // the other kernels ask for the head's share before it
                if (hd == 64)
                    attend_one<T, 64>(qr, k0, v0, off.data(), L, G, hd, scale, o, qf.data(), s.data(), acc.data(),
                                      kv.data());
                else if (hd == 128)
                    attend_one<T, 128>(qr, k0, v0, off.data(), L, G, hd, scale, o, qf.data(), s.data(), acc.data(),
                                       kv.data());
                else
                    attend_one<T, 0>(qr, k0, v0, off.data(), L, G, hd, scale, o, qf.data(), s.data(), acc.data(),
                                     kv.data());
            }
        }
    });
}

// The index of each row's first maximum, as torch's max(dim).indices (a NaN counts as the maximum).
constexpr int64_t kArgmaxBlock = 64;

template <typename T>
void argmax_rows(const T* x, int64_t row_stride, int64_t n, int64_t width, int64_t* out, int nthreads) {
    parallel_rows(n, n * width >= 262144 ? nthreads : 1, [&](int64_t i) {
        const T* r = x + i * row_stride;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t j = 0; j < width; ++j) {
            const float v = Num<T>::ld(r[j]);
            m = v > m ? v : m;
            nan |= v != v;
        }
        // the first index holding it: a NaN's by a scan; the maximum's by a vector count per block of kArgmaxBlock,
        // then a scan of the first block that holds it
        int64_t at = 0;
        if (nan) {
            while (at < width && !(Num<T>::ld(r[at]) != Num<T>::ld(r[at])))
                ++at;
        } else {
            for (int64_t j0 = 0; j0 < width; j0 += kArgmaxBlock) {
                const int64_t end = std::min(width, j0 + kArgmaxBlock);
                int hit = 0;
#pragma omp simd reduction(+ : hit)
                for (int64_t j = j0; j < end; ++j)
                    hit += Num<T>::ld(r[j]) == m;
                if (!hit)
                    continue;
                at = j0;
                while (Num<T>::ld(r[at]) != m)
                    ++at;
                break;
            }
        }
        out[i] = at;
    });
}


// ---- Sampling ----------------------------------------------------------------------------------------------------
// One token per row of logits [n, width] (row stride ld), drawn as engine/sampler.py's torch path draws it: x =
// logits / T; top-k (0 < k < width) keeps the values >= the k-th largest (ties stay); p = softmax over the kept; top-p
// (< 1) keeps the smallest prefix of the p sorted from the largest whose mass reaches top_p (of tokens tied at its last
// value, the first ones in vocabulary order, as a stable sort would keep them); the token
// is the first index, in vocabulary order, where the kept mass from index 0 exceeds u x the kept total. Every row
// touches its logits once and its probabilities a few times, with no sort of the vocabulary: the nucleus's edge is
// found from the mass per bucket of the probabilities' float bits (they order the values), and only the edge
// bucket's values are sorted. Row i of the batch is row rows[i] of the logits; out[i] = -1 for a row with a NaN or
// +inf logit, or nothing kept.
constexpr int kSampleBucketShift = 20;  // 11 bits of a non-negative float: 8 of exponent, 3 of mantissa

template <typename T>
void sample_rows(const T* logits, int64_t ld, const int64_t* rows, int64_t n, int64_t width, const float* temp,
                 const int64_t* top_k, const float* top_p, const float* u, int64_t* out, int nthreads) {
    parallel_for(n, n * width >= 65536 ? nthreads : 1, [&](int64_t i) {
        thread_local std::vector<float> e, pick;
        thread_local std::vector<double> mass;
        if (static_cast<int64_t>(e.size()) < width) e.resize(width);
        float* x = e.data();
        const T* r = logits + rows[i] * ld;
        const float t = temp[i];
        float m = -INFINITY;
        int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
        for (int64_t j = 0; j < width; ++j) {
            const float v = Num<T>::ld(r[j]) / t;
            x[j] = v;
            m = v > m ? v : m;
            bad |= v != v;
        }
        out[i] = -1;
        if (bad || m == INFINITY || m == -INFINITY) return;
        float kth = -INFINITY;  // top-k: the k-th largest value; below it, a token weighs 0
        const int64_t k = top_k[i];
        if (k > 0 && k < width && k <= 1024) {  // a min-heap of the k largest so far: few values get past its top
            pick.assign(x, x + k);
            std::make_heap(pick.begin(), pick.end(), std::greater<float>());
            for (int64_t j = k; j < width; ++j)
                if (x[j] > pick.front()) {
                    std::pop_heap(pick.begin(), pick.end(), std::greater<float>());
                    pick.back() = x[j];
                    std::push_heap(pick.begin(), pick.end(), std::greater<float>());
                }
            kth = pick.front();
        } else if (k > 0 && k < width) {
            pick.assign(x, x + width);
            std::nth_element(pick.begin(), pick.begin() + (k - 1), pick.end(), std::greater<float>());
            kth = pick[k - 1];
        }
        const float cut = std::max(kth, std::nextafter(-INFINITY, 0.f));  // a masked (-inf) token weighs 0 too
        double total = 0.0;  // of the weights exp(x - m), in [0, 1]
        {
            int64_t j = 0;
#ifdef __AVX2__
            const __m256 mv = _mm256_set1_ps(m), cv = _mm256_set1_ps(cut);
            __m256 acc = _mm256_setzero_ps();
            for (; j + 8 <= width; j += 8) {
                const __m256 v = _mm256_loadu_ps(x + j);
                const __m256 w = _mm256_and_ps(exp_nonpos_v<Vec8>(_mm256_sub_ps(v, mv)),
                                               _mm256_cmp_ps(v, cv, _CMP_GE_OQ));
                _mm256_storeu_ps(x + j, w);
                acc = _mm256_add_ps(acc, w);
            }
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, acc);
            for (const float l : lanes) total += l;
#endif
            for (; j < width; ++j) {
                x[j] = x[j] >= cut ? exp_nonpos(x[j] - m) : 0.f;
                total += x[j];
            }
        }
        float keep = 0.f;     // the smallest weight kept...
        int64_t ties = width;  // ...and how many tokens of that weight, the first ones in vocabulary order
        if (top_p[i] < 1.f) {
            const double target = static_cast<double>(top_p[i]) * total;
            // two histograms, even and odd tokens, so that runs of tokens in one bucket do not wait on each other
            const int64_t buckets = (0x7f800000 >> kSampleBucketShift) + 1;
            mass.assign(2 * buckets, 0.0);
            for (int64_t j = 0; j < width; ++j) {
                uint32_t bits;
                std::memcpy(&bits, x + j, sizeof(bits));
                if (bits != 0) mass[(j & 1) * buckets + (bits >> kSampleBucketShift)] += x[j];
            }
            for (int64_t b = 0; b < buckets; ++b) mass[b] += mass[buckets + b];
            mass.resize(buckets);
            int64_t edge = 0;  // the bucket where the mass from the top reaches top_p
            double above = 0.0;
            for (int64_t b = static_cast<int64_t>(mass.size()) - 1; b >= 0; --b) {
                if (above + mass[b] >= target) {
                    edge = b;
                    break;
                }
                above += mass[b];
            }
            pick.clear();
            for (int64_t j = 0; j < width; ++j) {
                uint32_t bits;
                std::memcpy(&bits, x + j, sizeof(bits));
                if ((bits >> kSampleBucketShift) == static_cast<uint32_t>(edge)) pick.push_back(x[j]);
            }
            std::sort(pick.begin(), pick.end(), std::greater<float>());
            keep = pick.empty() ? 0.f : pick.back();
            ties = static_cast<int64_t>(pick.size());
            for (size_t a = 0; a < pick.size(); ++a) {  // the sorted prefix reaching top_p: its last value, and how
                above += pick[a];                        // many of the tokens of that value it holds
                if (above >= target) {
                    keep = pick[a];
                    ties = static_cast<int64_t>(a + 1 - (std::lower_bound(pick.begin(), pick.end(), keep,
                                                                          std::greater<float>()) - pick.begin()));
                    break;
                }
            }
            float kept = 0.f;
#pragma omp simd reduction(+ : kept)
            for (int64_t j = 0; j < width; ++j) kept += x[j] > keep ? x[j] : 0.f;
            total = static_cast<double>(kept) + static_cast<double>(ties) * keep;
        }
        if (!(total > 0.0)) return;
        const float goal = u[i] * static_cast<float>(total);
        float run = 0.f;
        int64_t last = -1;
        for (int64_t j = 0; j < width; ++j) {
            const float w = x[j];
            if (w > 0.f && (w > keep || (w == keep && ties-- > 0))) {
                run += w;
                last = j;
                if (run > goal) break;
            }
        }
        out[i] = last;  // past the goal, or (rounding) the last kept token
    });
}

// ---- Linear layers on packed bf16 weights (AMX, else AVX512-BF16) ---------------------------------------------
// A weight W [N, K] is packed once at load (engine/cpu_kernels.py: pack_weight) into panels of 16 output columns;
// a panel holds K/2 rows of 64 bytes, each 16 columns x 2 consecutive k (the "VNNI" pairs that AMX's bf16 dot
// product reads): P[p][kk][c][e] = W[16p + c][2kk + e]. Columns are padded with zeros to a multiple of 32, K must
// be a multiple of 32. Panels are walked two at a time (32 columns) and the threads split the panel pairs, so each
// thread streams its share of the weights once per block of activation rows; fp32 accumulation in AMX's tiles (or
// in AVX-512 registers where the CPU has its bf16 dot product but no AMX: dp_block), then one epilogue per 32
// columns: the bias, a residual add, or silu(gate) * up for a gate|up pair packed panel by panel.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(KAIROS_AVX512_BF16)
#define KAIROS_AMX 1

struct TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

inline void amx_configure() {  // tiles 0-3: C (16 x 16 fp32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 k-pairs x 32 bf16)
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

// c [16 * MT][32] fp32 = a's MT tiles of 16 rows (row stride lda elements) x panels b0 | b1, over k.
template <int MT>
inline void amx_block(const bf16* a, int64_t lda, const bf16* b0, const bf16* b1, int64_t k, float* c) {
    _tile_zero(0);
    _tile_zero(1);
    if (MT == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const int64_t sa = lda * 2;
    for (int64_t kb = 0; kb < k; kb += 32) {
        _tile_loadd(4, a + kb, sa);
        _tile_loadd(6, b0 + kb * 16, 64);
        _tile_loadd(7, b1 + kb * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (MT == 2) {
            _tile_loadd(5, a + 16 * lda + kb, sa);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (MT == 2) {
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    }
}

#endif

#ifdef __AVX2__
// The packed GEMMs' weight asks: during step kk of a block's k loop, lines 2 kk and 2 kk + 1 of the pf_lines cache
// lines from pf (the pair computed next) into L2
inline void ask_lines_of(const char* pf, int64_t kk, int64_t pf_lines) {
    if (2 * kk < pf_lines) {
        _mm_prefetch(pf + 128 * kk, _MM_HINT_T1);
        if (2 * kk + 1 < pf_lines) _mm_prefetch(pf + 128 * kk + 64, _MM_HINT_T1);
    }
}
#endif

#ifdef KAIROS_AVX512_BF16
// Without AMX (e.g. AMD Zen 4): the same block from AVX-512's bf16 dot product of k pairs, which reads the packed
// panels as they are (a panel's row of 16 columns x 2 k is one 512-bit register). c [R][32] fp32 = R rows of a (row
// stride lda elements) x panels b0 | b1, over k. R <= 12: 2R accumulators, 2 weight rows and a broadcast in 32
// registers. Each row's k pair is broadcast to all 16 lanes; the sums run in the order AMX's run (k pair by pair).
// pf, pf_lines: cache lines (of the next panel pair) to ask for into L2 meanwhile, two per k pair.
template <int R>
inline void dp_block(const bf16* a, int64_t lda, const bf16* b0, const bf16* b1, int64_t k, float* c,
                     const char* pf, int64_t pf_lines) {
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k / 2; ++kk) {
        ask_lines_of(pf, kk, pf_lines);
        const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b0 + kk * 32));
        const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b1 + kk * 32));
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, a + r * lda + 2 * kk, sizeof(pair));
            const __m512bh xa = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
            acc0[r] = _mm512_dpbf16_ps(acc0[r], xa, w0);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], xa, w1);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(c + r * 32, acc0[r]);
        _mm512_storeu_ps(c + r * 32 + 16, acc1[r]);
    }
}

constexpr int kDpRows = 12;

inline void dp_rows(const bf16* a, int64_t lda, int64_t rows, const bf16* b0, const bf16* b1, int64_t k, float* c,
                    const char* pf, int64_t pf_lines) {
    switch (rows) {
#define KAIROS_DP_CASE(R) \
    case R: dp_block<R>(a, lda, b0, b1, k, c, pf, pf_lines); break;
        KAIROS_DP_CASE(1) KAIROS_DP_CASE(2) KAIROS_DP_CASE(3) KAIROS_DP_CASE(4) KAIROS_DP_CASE(5) KAIROS_DP_CASE(6)
        KAIROS_DP_CASE(7) KAIROS_DP_CASE(8) KAIROS_DP_CASE(9) KAIROS_DP_CASE(10) KAIROS_DP_CASE(11) KAIROS_DP_CASE(12)
#undef KAIROS_DP_CASE
        default: break;
    }
}

#endif

// A kernel's answer where this build lacks its instructions: 2 (its arguments only keep them from being unused)
template <typename... A>
inline int not_built(const A&...) { return 2; }

// Which instructions gemm_packed runs: AMX's tiles where built with them and the OS grants this process their state
// (packed_gemm_enable), else AVX-512's bf16 dot products where built with them, else AVX2's fp32 FMAs on the bf16
// weights widened in registers (gemm_bf16_fma) where built with FMA, else none.
enum PackedIsa { kIsaNone = 0, kIsaAvx2Fma = 1, kIsaAvx512Bf16 = 2, kIsaAmx = 3 };
std::atomic<int> packed_isa{kIsaNone};

inline float silu(float g) {  // g * sigmoid(g), with exp of a non-positive argument only
    const float e = exp_nonpos(g < 0.f ? g : -g);
    const float s = (g < 0.f ? e : 1.f) / (1.f + e);
    return g * s;
}

enum Epilogue { kPlain = 0, kResidual = 1, kSiluMul = 2 };

// rows [m0, m0 + nrows) of the output from c [nrows][32] for panel pair `pair`: + bias, then + the residual (in
// place) as torch adds them (h + (x @ W^T + b), each op rounded to T), or silu(gate) * up
template <typename T>
inline void gemm_epilogue(const float* c, int64_t nrows, int64_t m0, int64_t pair, int64_t n, const T* bias,
                          const T* res, T* out, int64_t ldo, int mode) {
    if (mode == kSiluMul) {  // panels: gate, up of the same 16 features; n is the features' count
        const int64_t n0 = pair * 16, w = std::min<int64_t>(16, n - n0);
        for (int64_t r = 0; r < nrows; ++r) {
            const float* cr = c + r * 32;
            T* o = out + (m0 + r) * ldo + n0;
#ifdef KAIROS_AVX512_BF16
            if constexpr (std::is_same_v<T, bf16>) {
                if (w == 16) {
                    const __m512 g = round16(_mm512_loadu_ps(cr));
                    st16(o, _mm512_mul_ps(round16(silu_v<Vec16>(g)), round16(_mm512_loadu_ps(cr + 16))));
                    continue;
                }
            }
#endif
#ifdef __AVX2__
            if constexpr (std::is_same_v<T, float>) {  // 2 x 8 or 1 x 16 lanes: the scalar loop does not vectorise
                if (w == 16) {
                    for (int j = 0; j < 16; j += VecWide::W)
                        VecWide::store(o + j, VecWide::mul(silu_v<VecWide>(VecWide::load(cr + j)),
                                                           VecWide::load(cr + 16 + j)));
                    continue;
                }
            }
#endif
#pragma omp simd
            for (int64_t j = 0; j < w; ++j) {
                const float g = Num<T>::round(cr[j]), u = Num<T>::round(cr[16 + j]);
                o[j] = Num<T>::st(Num<T>::round(silu(g)) * u);
            }
        }
        return;
    }
    const int64_t n0 = pair * 32, w = std::min<int64_t>(32, n - n0);
#ifdef KAIROS_AVX512_BF16
    if constexpr (std::is_same_v<T, bf16>) {
        if (w == 32) {
            const __m512 b0 = bias == nullptr ? _mm512_setzero_ps() : ld16(bias + n0);
            const __m512 b1 = bias == nullptr ? _mm512_setzero_ps() : ld16(bias + n0 + 16);
            for (int64_t r = 0; r < nrows; ++r) {
                const float* cr = c + r * 32;
                bf16* o = out + (m0 + r) * ldo + n0;
                __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(cr), b0), v1 = _mm512_add_ps(_mm512_loadu_ps(cr + 16), b1);
                if (mode == kResidual) {
                    const bf16* h = res + (m0 + r) * ldo + n0;
                    v0 = _mm512_add_ps(round16(v0), ld16(h));
                    v1 = _mm512_add_ps(round16(v1), ld16(h + 16));
                }
                st16(o, v0);
                st16(o + 16, v1);
            }
            return;
        }
    }
#endif
    for (int64_t r = 0; r < nrows; ++r) {
        const float* cr = c + r * 32;
        T* o = out + (m0 + r) * ldo + n0;
        const T* h = res == nullptr ? nullptr : res + (m0 + r) * ldo + n0;
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) {
            float v = cr[j];
            if (bias != nullptr) v += Num<T>::ld(bias[n0 + j]);
            if (mode == kResidual) v = Num<T>::round(v) + Num<T>::ld(h[j]);
            o[j] = Num<T>::st(v);
        }
    }
}

// ---- Grid weights ("grid4", "grid8") ---------------------------------------------------------------------------
// An fp32 weight whose every block of 32 consecutive k of an output column holds values fl(fl(d * q) + m), with d and m
// one fp32 pair per block and q 4-bit unsigned (0..15: a Q4_1 GGUF de-quantized to fp32, as the default model's layers
// are) or 8-bit signed (m = 0: Q8_0, as its embedding is), is packed as its q: per panel of 16 columns and block of 32
// k, d[16] and m[16] (fp32, one per column), then the q of each of the 32 k: grid4 8 bytes, byte j holding column j's
// q in its low nibble and column j + 8's in its high one (384 bytes for 512 weights; fp32: 2,048), grid8 16 int8
// (640 bytes). `CpuKernels.find_grid` (grid_find below; `grid` in engine/cpu_kernels.py is its torch reference)
// finds d, m and q exactly or refuses. The GEMM builds the fp32 values with the same two roundings (a multiply, then
// an add), so it multiplies the very values the checkpoint holds, in the fp32 GEMM's order: the same output bit for
// bit.
constexpr int64_t kGridK = 32;
constexpr int64_t grid_block_bytes(int bits) { return 128 + 64 * bits; }

#ifdef __AVX2__
// columns 0-7 and 8-15 of a block's q at k index kk, as int32 lanes
template <int Bits>
inline void grid_q(const uint8_t* q, int64_t kk, __m256i& lo, __m256i& hi) {
    if constexpr (Bits == 4) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * kk)));
        lo = _mm256_and_si256(v, _mm256_set1_epi32(15));
        hi = _mm256_srli_epi32(v, 4);
    } else {
        lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * kk)));
        hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * kk + 8)));
    }
}

// fl(fl(d * q) + m): two roundings only because the build passes -ffp-contract=off (GCC's intrinsics are plain
// vector arithmetic, which it would otherwise fuse into one FMA; the grid tests compare bit for bit)
inline __m256 grid_value(__m256i q, __m256 d, __m256 m) {
    return _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m);
}
#endif

// The panel pair at `pair` (K = k), k in [k0, k0 + kn) (multiples of 32), into out [2][kn][16] floats
template <int Bits>
inline void grid_unpack(const uint8_t* pair, int64_t k, int64_t k0, int64_t kn, float* out) {
    constexpr int64_t bytes = grid_block_bytes(Bits);
    const int64_t panel = k / kGridK * bytes;
    for (int h = 0; h < 2; ++h) {
        const uint8_t* blk = pair + h * panel + k0 / kGridK * bytes;
        float* o = out + h * 16 * kn;
        for (int64_t b = 0; b < kn / kGridK; ++b, blk += bytes) {
            float dm[32];  // d[16], m[16]
            std::memcpy(dm, blk, sizeof(dm));
            const uint8_t* q = blk + sizeof(dm);
#ifdef __AVX2__
            const __m256 d0 = _mm256_loadu_ps(dm), d1 = _mm256_loadu_ps(dm + 8);
            const __m256 m0 = _mm256_loadu_ps(dm + 16), m1 = _mm256_loadu_ps(dm + 24);
            for (int kk = 0; kk < kGridK; ++kk, o += 16) {
                __m256i lo, hi;
                grid_q<Bits>(q, kk, lo, hi);
                _mm256_storeu_ps(o, grid_value(lo, d0, m0));
                _mm256_storeu_ps(o + 8, grid_value(hi, d1, m1));
            }
#else
            for (int kk = 0; kk < kGridK; ++kk, o += 16)
                for (int j = 0; j < 16; ++j) {
                    const int qj = Bits == 4 ? (q[8 * kk + j % 8] >> (j < 8 ? 0 : 4)) & 15
                                             : static_cast<int8_t>(q[16 * kk + j]);
                    o[j] = dm[j] * static_cast<float>(qj) + dm[16 + j];
                }
#endif
        }
    }
}

// Finding a weight's grid (CpuKernels.find_grid): per block of 32 values, m (4 bits: the minimum, at q = 0; 8 bits: 0)
// and d from the step (4 bits: (max - m) / 15; 8 bits: the largest magnitude / 127) rounded to fp16, its two fp16
// neighbours, then the fp32 step; the first d whose rounded, clamped q rebuild all 32 values bit for bit wins. The same
// search, op for op, as `grid` in engine/cpu_kernels.py (torch), in one pass (every block, no probe). grid_block:
// whether one block is on the grid (d, m and q written if so); grid_find: 1 every block is, 0 not, -1 this build cannot
// search (no F16C).
template <int Bits, typename Q>
bool grid_block(const float* v, float& d_out, float& m_out, Q* q_out) {
#ifdef __F16C__
    float lo = v[0], hi = v[0];
    bool finite = true;
    for (int j = 0; j < kGridK; ++j) {  // branch-free loops, so that they vectorise
        finite &= std::fabs(v[j]) <= std::numeric_limits<float>::max();
        lo = std::min(lo, v[j]);
        hi = std::max(hi, v[j]);
    }
    if (!finite) return false;
    const float m = Bits == 4 ? lo : 0.f;
    const float step = Bits == 4 ? (hi - lo) / 15.f : std::max(std::fabs(lo), std::fabs(hi)) / 127.f;
    const float q_lo = Bits == 4 ? 0.f : -128.f, q_hi = Bits == 4 ? 15.f : 127.f;
    const uint16_t half = _cvtss_sh(step, _MM_FROUND_TO_NEAREST_INT);
    const float candidates[4] = {_cvtsh_ss(half), _cvtsh_ss(static_cast<uint16_t>(half + 1)),
                                 _cvtsh_ss(static_cast<uint16_t>(half - 1)), step};
    for (float c : candidates) {
        if (!(std::isfinite(c) && c > 0.f)) c = 0.f;
        const float div = c > 0.f ? c : 1.f;
        uint32_t bad = 0;
        float qs[kGridK];
        for (int j = 0; j < kGridK; ++j) {
            const float q = c > 0.f ? std::min(q_hi, std::max(q_lo, std::nearbyint((v[j] - m) / div))) : 0.f;
            const float back = c * q + m;
            uint32_t got, want;
            std::memcpy(&got, &back, sizeof(got));
            std::memcpy(&want, &v[j], sizeof(want));
            bad |= got ^ want;
            qs[j] = q;
        }
        if (bad == 0) {
            d_out = c;
            m_out = m;
            for (int j = 0; j < kGridK; ++j) q_out[j] = static_cast<Q>(qs[j]);
            return true;
        }
    }
#else
    not_built(v, d_out, m_out, q_out);
#endif
    return false;
}

template <int Bits, typename Q>
int grid_find(const float* w, int64_t n, int64_t k, float* d, float* m, Q* q, int nthreads) {
#ifdef __F16C__
    std::atomic<bool> off{false};
    const int64_t blocks = k / kGridK;
    parallel_rows(n, nthreads, [&](int64_t i) {
        for (int64_t b = 0; b < blocks && !off.load(std::memory_order_relaxed); ++b)
            if (!grid_block<Bits>(w + i * k + b * kGridK, d[i * blocks + b], m[i * blocks + b],
                                  q + (i * blocks + b) * kGridK))
                off.store(true, std::memory_order_relaxed);
    });
    return off.load() ? 0 : 1;
#else
    not_built(w, n, k, d, m, q, nthreads);
    return -1;
#endif
}

// Few rows (1-3) with 8-lane vectors: c[r][0, 32) (+= with add) rows r of a (k0 applied) x the pair's k in [k0, k0 +
// kn) built in registers from its blocks, four sums a row as fma_both8 (no pass through memory: a GEMV's weights are
// read once anyway); pf / pf_lines as fma_cols
constexpr int kGridFusedRows = 3;
template <int Bits, int R>
inline void grid_rows(const float* a, int64_t lda, const uint8_t* pair, int64_t k, int64_t k0, int64_t kn, float* c,
                      const char* pf, int64_t pf_lines, bool add) {
#ifdef __AVX2__
    constexpr int64_t bytes = grid_block_bytes(Bits);
    const int64_t panel = k / kGridK * bytes;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = add ? _mm256_loadu_ps(c + r * 32 + 8 * v) : _mm256_setzero_ps();
    for (int64_t b = 0; b < kn / kGridK; ++b) {
        const uint8_t* blk[2] = {pair + (k0 / kGridK + b) * bytes, pair + panel + (k0 / kGridK + b) * bytes};
        const float* dm[2] = {reinterpret_cast<const float*>(blk[0]), reinterpret_cast<const float*>(blk[1])};
        for (int64_t kk = 0; kk < kGridK; ++kk) {
            ask_lines_of(pf, b * kGridK + kk, pf_lines);
            __m256 w[4];
            for (int h = 0; h < 2; ++h) {
                __m256i lo, hi;
                grid_q<Bits>(blk[h] + 128, kk, lo, hi);
                w[2 * h] = grid_value(lo, _mm256_loadu_ps(dm[h]), _mm256_loadu_ps(dm[h] + 16));
                w[2 * h + 1] = grid_value(hi, _mm256_loadu_ps(dm[h] + 8), _mm256_loadu_ps(dm[h] + 24));
            }
            for (int r = 0; r < R; ++r) {
                const __m256 xr = _mm256_set1_ps(a[r * lda + b * kGridK + kk]);
                for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xr, w[v], acc[r][v]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(c + r * 32 + 8 * v, acc[r][v]);
#else
    not_built(a, lda, pair, k, k0, kn, c, pf, pf_lines, add);
#endif
}

template <int Bits>
inline void grid_few_rows(const float* a, int64_t lda, int64_t rows, const uint8_t* pair, int64_t k, int64_t k0,
                          int64_t kn, float* c, const char* pf, int64_t pf_lines, bool add) {
    switch (rows) {
        case 1: grid_rows<Bits, 1>(a, lda, pair, k, k0, kn, c, pf, pf_lines, add); break;
        case 2: grid_rows<Bits, 2>(a, lda, pair, k, k0, kn, c, pf, pf_lines, add); break;
        case 3: grid_rows<Bits, 3>(a, lda, pair, k, k0, kn, c, pf, pf_lines, add); break;
        default: break;
    }
}

constexpr int64_t kAskNextRunRows = 8;
constexpr int64_t kRowsPerPass = 256;  // gemm_blocked's rows a pass over the weights
// The fp32 GEMM's k chunks with 8-lane vectors (gemm_blocked): kChunkK below kChunkRowsBelow rows, kChunkKMany below
// kChunkRowsUpTo, then none: measured on a Zen 4 built without AVX-512 against walking the whole K per group, with
// SmolLM2's layers streamed from memory (the sizes where each chunking was faster). With 16-lane vectors (and bf16)
// chunks did not help: 12 rows a group cover a decode step in one to three groups.
constexpr int64_t kChunkK = 32, kChunkKMany = 128, kChunkRowsBelow = 32, kChunkRowsUpTo = 64;
static_assert(kChunkK % kGridK == 0 && kChunkKMany % kGridK == 0, "grid weights unpack whole blocks of k");

// gemm_packed's tasks, as runs of panel pairs [at[j], at[j + 1]): guided, each about a (2 x nthreads)th of the pairs
// still unassigned, so that a thread streams long runs first (the next pair fetched while one computes) and the
// threads end within a pair or two of each other (equal runs left one thread idle for up to a run at the end).
inline std::vector<int64_t> pair_runs(int64_t pairs, int nthreads) {
    std::vector<int64_t> at{0};
    const int64_t parts = 2 * std::max(1, nthreads);
    while (at.back() < pairs) at.push_back(at.back() + std::max<int64_t>(1, (pairs - at.back()) / parts));
    return at;
}

// The register-blocked packed GEMMs (AVX512-BF16 dot products, fp32 FMAs): out [m, n] = x [m, k] @ W^T, W packed in
// panel pairs. Tasks are runs of pairs (pair_runs), each streamed once per block of 256 rows; each thread claims runs
// in order until none is left. Per pair, rows_fn(x rows, ldx, rows, panel 0, panel 1, k, c, ask, ask_lines) computes
// row groups of up to R rows into c [R][32] floats (the thread's), then the epilogue writes them out; meanwhile each
// group asks for its share of the pair most likely computed next (ask_lines cache lines from ask): the run's next
// pair, else its first again (the next block of rows), else, from kAskNextRunRows rows on, the first pair of the run
// next to be claimed, so that a run's first pair does not start cold (with fewer rows the weights' stream is the
// step, and the extra asks slowed it). rows_fn is a lambda, so that the kernel inlines into the walk. With Chunk > 0
// (below), rows_fn takes one more argument, add: start from c's sums (a later chunk of k).
//
// GridBits 4 or 8 (TW uint8_t, grid weights): each pair's k range is unpacked to fp32 panels in the thread's scratch
// first (grid_unpack), the whole K once per block of rows, or a chunk at a time, and rows_fn reads those; with 8-lane
// vectors, up to kGridFusedRows rows multiply the blocks straight (grid_rows).
template <int R, int64_t Chunk, int GridBits = 0, typename TX, typename TW, typename T, typename RowsFn>
void gemm_blocked(const TX* x, int64_t ldx, int64_t m, int64_t k, const TW* w, int64_t pairs, int64_t n, const T* bias,
                  const T* res, T* out, int64_t ldo, int mode, int nthreads, RowsFn&& rows_fn) {
    constexpr bool Grid = GridBits != 0;
    const int64_t panel = Grid ? k / kGridK * grid_block_bytes(GridBits) : 16 * k;  // elements of TW
    const int64_t pair_lines = 2 * panel * static_cast<int64_t>(sizeof(TW)) / 64;
    const std::vector<int64_t> runs = pair_runs(pairs, nthreads);
    const int64_t tasks = static_cast<int64_t>(runs.size()) - 1;
    std::atomic<int64_t> claimed{0};
    // Chunk > 0 (callers: fewer than kChunkRowsUpTo rows): the pair is walked Chunk k at a time, every row group (and
    // with 8-lane vectors each panel of the pair) in turn on each chunk, so that they read the chunk's weights from L1
    // (a whole pair, 32 columns x K, outgrows L1). Chunk 0: each group walks the whole K, its epilogue right after.
    const int64_t pass = Chunk > 0 ? kChunkRowsUpTo : kRowsPerPass;  // rows a pass over the weights
    parallel_for(std::min<int64_t>(tasks, nthreads), nthreads, [&](int64_t) {
        alignas(64) float c[(Chunk > 0 ? kChunkRowsUpTo + R : R) * 32];  // a group's sums, or every group's
        float* unpacked = nullptr;  // Grid: the pair's k range as fp32 panels [2][kn][16]
        if constexpr (Grid) {
            thread_local std::vector<float> scratch;
            const size_t need = 32 * static_cast<size_t>(Chunk > 0 ? std::min(Chunk, k) : k);
            if (scratch.size() < need) scratch.resize(need);
            unpacked = scratch.data();
        }
        // the pair at b0's k in [k0, k0 + kn) as rows_fn reads them: panel 0 and panel 1
        auto panels = [&](const TW* b0, int64_t k0, int64_t kn) {
            if constexpr (Grid) {
                grid_unpack<GridBits>(b0, k, k0, kn, unpacked);
                return std::pair<const float*, const float*>(unpacked, unpacked + 16 * kn);
            } else {
                return std::pair<const TW*, const TW*>(b0 + 16 * k0, b0 + panel + 16 * k0);
            }
        };
        for (int64_t task = claimed.fetch_add(1, std::memory_order_relaxed); task < tasks;
             task = claimed.fetch_add(1, std::memory_order_relaxed)) {
            const int64_t p0 = runs[task], p1 = runs[task + 1];
            for (int64_t r0 = 0; r0 < m; r0 += pass) {
                const int64_t r1 = std::min(m, r0 + pass);
                for (int64_t p = p0; p < p1; ++p) {
                    const TW* b0 = w + 2 * p * panel;
                    int64_t ahead = p + 1;
                    if (ahead == p1) {
                        const int64_t t = claimed.load(std::memory_order_relaxed);
                        ahead = r1 < m ? p0 : t < tasks && m >= kAskNextRunRows ? runs[t] : -1;
                    }
                    const char* next = reinterpret_cast<const char*>(w + 2 * std::max<int64_t>(ahead, 0) * panel);
                    const int64_t lines = ahead >= 0 ? pair_lines : 0;
                    const int64_t groups = (r1 - r0 + R - 1) / R;
                    if constexpr (Chunk == 0) {
                        const int64_t share = (lines + groups - 1) / groups;
                        const auto pp = panels(b0, 0, k);
                        for (int64_t i = r0, g = 0; i < r1; i += R, ++g) {
                            const int64_t rows = std::min<int64_t>(R, r1 - i), first = std::min(lines, g * share);
                            rows_fn(x + i * ldx, ldx, rows, pp.first, pp.second, k, c, next + 64 * first,
                                    std::min(lines, first + share) - first);
                            gemm_epilogue(c, rows, i, p, n, bias, res, out, ldo, mode);
                        }
                    } else {
                        for (int64_t k0 = 0; k0 < k; k0 += Chunk) {  // the chunk's share of the asks, split by group
                            const int64_t kn = std::min(Chunk, k - k0), first = lines * k0 / k;
                            const int64_t asks = lines * (k0 + kn) / k - first, share = (asks + groups - 1) / groups;
                            if constexpr (Grid && VecWide::W == 8) {
                                if (r1 - r0 <= kGridFusedRows) {
                                    grid_few_rows<GridBits>(x + r0 * ldx + k0, ldx, r1 - r0, b0, k, k0, kn, c,
                                                            next + 64 * first, asks, k0 > 0);
                                    continue;
                                }
                            }
                            const auto pp = panels(b0, k0, kn);
                            for (int64_t i = r0, g = 0; i < r1; i += R, ++g) {
                                const int64_t from = std::min(asks, g * share);
                                rows_fn(x + i * ldx + k0, ldx, std::min<int64_t>(R, r1 - i), pp.first, pp.second, kn,
                                        c + g * R * 32, next + 64 * (first + from),
                                        std::min(asks, from + share) - from, k0 > 0);
                            }
                        }
                        for (int64_t i = r0, g = 0; i < r1; i += R, ++g)
                            gemm_epilogue(c + g * R * 32, std::min<int64_t>(R, r1 - i), i, p, n, bias, res, out, ldo,
                                          mode);
                    }
                }
            }
        }
    });
}

int gemm_bf16_fma(const bf16* x, int64_t ldx, int64_t m, int64_t k, const bf16* w, int64_t pairs, int64_t n,
                  const bf16* bias, const bf16* res, bf16* out, int64_t ldo, int mode, int nthreads);

// The walk of the GEMMs with 8-lane vectors: k chunks below kChunkRowsUpTo rows (kChunkK's note), then the whole K
template <int R, int GridBits = 0, typename TX, typename TW, typename T, typename RowsFn>
void gemm_walk8(const TX* x, int64_t ldx, int64_t m, int64_t k, const TW* w, int64_t pairs, int64_t n, const T* bias,
                const T* res, T* out, int64_t ldo, int mode, int nthreads, RowsFn&& rows_fn) {
    if (m < kChunkRowsBelow)
        gemm_blocked<R, kChunkK, GridBits>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads, rows_fn);
    else if (m < kChunkRowsUpTo)
        gemm_blocked<R, kChunkKMany, GridBits>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads, rows_fn);
    else
        gemm_blocked<R, 0, GridBits>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads, rows_fn);
}

// out [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ W^T, W packed as above with `pairs` panel pairs.
int gemm_packed(const bf16* x, int64_t ldx, int64_t m, int64_t k, const bf16* w, int64_t pairs, int64_t n,
                const bf16* bias, const bf16* res, bf16* out, int64_t ldo, int mode, int nthreads) {
    if (k % 32 != 0) return 1;
    const int isa = packed_isa.load(std::memory_order_relaxed);
    const int64_t panel = 16 * k;  // elements
    if (isa == kIsaAvx2Fma) return gemm_bf16_fma(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads);
#ifdef KAIROS_AVX512_BF16
    if (isa == kIsaAvx512Bf16) {
        gemm_blocked<kDpRows, 0>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads,
                              [](auto... a) { dp_rows(a...); });
        return 0;
    }
#endif
#ifdef KAIROS_AMX
    if (isa != kIsaAmx) return 2;
    const std::vector<int64_t> runs = pair_runs(pairs, nthreads);  // a task: a run, streamed once per block of rows
    const int64_t tasks = static_cast<int64_t>(runs.size()) - 1;
    const int64_t full = m / 16, tiles = (m + 15) / 16;
    std::vector<bf16> tail;  // the last partial tile's rows, zero-padded to 16
    if (tiles > full) {
        tail.assign(16 * k, 0);
        for (int64_t r = 0; r < m - 16 * full; ++r)
            std::memcpy(tail.data() + r * k, x + (16 * full + r) * ldx, k * sizeof(bf16));
    }
    const int64_t chunk = 16;  // tiles of rows per pass over the weights (256 rows)
    parallel_for(tasks, nthreads, [&](int64_t task) {
        amx_configure();  // per task: the thread may have run other AMX code (oneDNN) since its last
        alignas(64) float c[32 * 32];
        const int64_t p0 = runs[task], p1 = runs[task + 1];
        for (int64_t t0 = 0; t0 < tiles; t0 += chunk) {
            const int64_t t1 = std::min(tiles, t0 + chunk);
            for (int64_t p = p0; p < p1; ++p) {
                const bf16* b0 = w + 2 * p * panel;
                const bf16* b1 = b0 + panel;
                for (int64_t i = t0; i < t1; i += 2) {
                    const bool two = i + 1 < t1 && i + 1 < full;  // both tiles read straight from x
                    const bf16* a = i < full ? x + 16 * i * ldx : tail.data();
                    const int64_t lda = i < full ? ldx : k;
                    if (two)
                        amx_block<2>(a, lda, b0, b1, k, c);
                    else
                        amx_block<1>(a, lda, b0, b1, k, c);
                    const int64_t rows = std::min<int64_t>(two ? 32 : 16, m - 16 * i);
                    gemm_epilogue(c, rows, 16 * i, p, n, bias, res, out, ldo, mode);
                    if (!two && i + 1 < t1) {  // the second tile alone (the partial one)
                        const bf16* a2 = i + 1 < full ? x + 16 * (i + 1) * ldx : tail.data();
                        amx_block<1>(a2, i + 1 < full ? ldx : k, b0, b1, k, c);
                        gemm_epilogue(c, std::min<int64_t>(16, m - 16 * (i + 1)), 16 * (i + 1), p, n, bias, res,
                                      out, ldo, mode);
                    }
                }
            }
        }
        _tile_release();
    });
    return 0;
#else
    return not_built(x, ldx, m, w, pairs, n, bias, res, out, ldo, mode, isa, panel, nthreads);
#endif
}

// ---- Linear layers on packed fp32 weights (AVX2 or AVX-512 FMA) ------------------------------------------------
// fp32 models, and every model on a CPU without native bf16 (where dtype "auto" is fp32). torch's fp32 linear (MKL's
// sgemm) re-reads the weight for each of 1-3 rows (2 rows took 1.9x one row's time, 3 rows 2.8x, on a 2-core Zen 4),
// so a decode step of 2-3 requests cost more than one of 4. The same scheme as the bf16 GEMM above: W [N, K] packed
// once at load into panels of 16 output columns, each K rows of 16 floats (P[p][kk][c] = W[16p + c][kk]), columns
// padded with zeros to a multiple of 32 (panel pairs); the threads split the pairs, each streams its share of the
// weights once per block of rows and asks for the next pair meanwhile; kFmaRows rows at a time are multiplied in
// registers (each row's k-th input broadcast, one FMA per 16 or 8 columns), then the same epilogues in fp32.
#if defined(__AVX2__) && defined(__FMA__)
#define KAIROS_PACKED_F32 1
constexpr int kFmaRows = VecWide::W == 16 ? 12 : 6;  // 2 accumulators a row, 2 weight vectors and a broadcast

// c[r][j] (row stride 32) for j in [0, 2W) = rows r of a (row stride lda) x the 2W columns whose k-th weights are
// w0[16 kk, +W) | w1[16 kk, +W); meanwhile asks for pf's first pf_lines cache lines (two per k). add: start from c's
// sums (a later chunk of k)
template <int R>
inline void fma_cols(const float* a, int64_t lda, const float* w0, const float* w1, int64_t k, float* c,
                     const char* pf, int64_t pf_lines, bool add) {
    using Vec = VecWide;
    typename Vec::V acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) {
        acc0[r] = add ? Vec::load(c + r * 32) : Vec::zero();
        acc1[r] = add ? Vec::load(c + r * 32 + Vec::W) : Vec::zero();
    }
    for (int64_t kk = 0; kk < k; ++kk) {
        ask_lines_of(pf, kk, pf_lines);
        const typename Vec::V b0 = Vec::load(w0 + 16 * kk), b1 = Vec::load(w1 + 16 * kk);
        for (int r = 0; r < R; ++r) {
            const typename Vec::V xr = Vec::set1(a[r * lda + kk]);
            acc0[r] = Vec::fmadd(xr, b0, acc0[r]);
            acc1[r] = Vec::fmadd(xr, b1, acc1[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        Vec::store(c + r * 32, acc0[r]);
        Vec::store(c + r * 32 + Vec::W, acc1[r]);
    }
}

// With 8-lane vectors and at most 3 rows: c[r][0, 32) from both panels in one pass (4 accumulators a row; with 3 rows
// the compiler reads the weights from L1 again rather than keep them in registers), so that the weights stream with
// four independent sums a row (a panel at a time was slower on a Zen 4, for a GEMV and for 1-3 rows of the LM head;
// `tests/test_cpu_kernels.py` builds it)
template <int R>
inline void fma_both8(const float* a, int64_t lda, const float* b0, const float* b1, int64_t k, float* c,
                      const char* pf, int64_t pf_lines, bool add) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = add ? _mm256_loadu_ps(c + r * 32 + 8 * v) : _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
        ask_lines_of(pf, kk, pf_lines);
        const __m256 w[4] = {_mm256_loadu_ps(b0 + 16 * kk), _mm256_loadu_ps(b0 + 16 * kk + 8),
                             _mm256_loadu_ps(b1 + 16 * kk), _mm256_loadu_ps(b1 + 16 * kk + 8)};
        for (int r = 0; r < R; ++r) {
            const __m256 xr = _mm256_set1_ps(a[r * lda + kk]);
            for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xr, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(c + r * 32 + 8 * v, acc[r][v]);
}

// c [rows][32] = rows of a x panels b0 | b1 (one call with 16-lane vectors, one per panel with 8-lane ones)
template <int R>
inline void fma_pair(const float* a, int64_t lda, const float* b0, const float* b1, int64_t k, float* c,
                     const char* pf, int64_t pf_lines, bool add) {
    if constexpr (VecWide::W == 16) {
        fma_cols<R>(a, lda, b0, b1, k, c, pf, pf_lines, add);
    } else if constexpr (R <= 3) {
        fma_both8<R>(a, lda, b0, b1, k, c, pf, pf_lines, add);
    } else {
        const int64_t half = (pf_lines + 1) / 2;
        fma_cols<R>(a, lda, b0, b0 + 8, k, c, pf, half, add);
        fma_cols<R>(a, lda, b1, b1 + 8, k, c + 16, pf + 64 * half, pf_lines - half, add);
    }
}

inline void fma_rows(const float* a, int64_t lda, int64_t rows, const float* b0, const float* b1, int64_t k,
                     float* c, const char* pf, int64_t pf_lines, bool add = false) {
    switch (rows) {
#define KAIROS_FMA_CASE(R) \
    case R: if constexpr (R <= kFmaRows) fma_pair<R>(a, lda, b0, b1, k, c, pf, pf_lines, add); break;
        KAIROS_FMA_CASE(1) KAIROS_FMA_CASE(2) KAIROS_FMA_CASE(3) KAIROS_FMA_CASE(4) KAIROS_FMA_CASE(5)
        KAIROS_FMA_CASE(6) KAIROS_FMA_CASE(7) KAIROS_FMA_CASE(8) KAIROS_FMA_CASE(9) KAIROS_FMA_CASE(10)
        KAIROS_FMA_CASE(11) KAIROS_FMA_CASE(12)
#undef KAIROS_FMA_CASE
        default: break;
    }
}

// bf16 weights in the bf16 GEMM's layout with fp32 FMAs, for CPUs without a bf16 dot product (AVX2; packed ISA
// "avx2_fma"): half the bytes of fp32 weights to stream. A panel's k pair is 16 columns x (k, k + 1) side by side, so
// a 256-bit load holds 8 columns' pairs as 32-bit lanes: shifted up by 16 they are the k weights, with the low 16 bits
// cleared the k + 1 weights, each exactly as fp32. Rows of a are fp32 (the caller widens the bf16 activations, which is
// exact); the sums run k by k in fp32 as the fp32 GEMM's do. c[r][0, 16) from panel b0, [16, 32) from b1; pf /
// pf_lines and add as fma_cols.
constexpr int kBf16FmaRows = 6;  // 2 accumulators a row, 2 weight vectors, a broadcast and the mask in 16 registers

template <int R>
inline void fma_bf16w(const float* a, int64_t lda, const bf16* b0, const bf16* b1, int64_t k, float* c,
                      const char* pf, int64_t pf_lines, bool add) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const int64_t half_lines = (pf_lines + 1) / 2;
    for (int h = 0; h < 2; ++h) {
        const bf16* b = h ? b1 : b0;
        float* cc = c + 16 * h;
        const char* ask = pf + 64 * (h ? half_lines : 0);
        const int64_t lines = h ? pf_lines - half_lines : half_lines;
        __m256 acc0[R], acc1[R];
        for (int r = 0; r < R; ++r) {
            acc0[r] = add ? _mm256_loadu_ps(cc + r * 32) : _mm256_setzero_ps();
            acc1[r] = add ? _mm256_loadu_ps(cc + r * 32 + 8) : _mm256_setzero_ps();
        }
        for (int64_t kk = 0; kk < k; kk += 2) {
            ask_lines_of(ask, kk / 2, lines);
            const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * kk));
            const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * kk + 16));
            __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
            __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
            for (int r = 0; r < R; ++r) {
                const __m256 xr = _mm256_set1_ps(a[r * lda + kk]);
                acc0[r] = _mm256_fmadd_ps(xr, w0, acc0[r]);
                acc1[r] = _mm256_fmadd_ps(xr, w1, acc1[r]);
            }
            w0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
            w1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
            for (int r = 0; r < R; ++r) {
                const __m256 xr = _mm256_set1_ps(a[r * lda + kk + 1]);
                acc0[r] = _mm256_fmadd_ps(xr, w0, acc0[r]);
                acc1[r] = _mm256_fmadd_ps(xr, w1, acc1[r]);
            }
        }
        for (int r = 0; r < R; ++r) {
            _mm256_storeu_ps(cc + r * 32, acc0[r]);
            _mm256_storeu_ps(cc + r * 32 + 8, acc1[r]);
        }
    }
}

inline void fma_rows_bf16w(const float* a, int64_t lda, int64_t rows, const bf16* b0, const bf16* b1, int64_t k,
                           float* c, const char* pf, int64_t pf_lines, bool add = false) {
    switch (rows) {
        case 1: fma_bf16w<1>(a, lda, b0, b1, k, c, pf, pf_lines, add); break;
        case 2: fma_bf16w<2>(a, lda, b0, b1, k, c, pf, pf_lines, add); break;
        case 3: fma_bf16w<3>(a, lda, b0, b1, k, c, pf, pf_lines, add); break;
        case 4: fma_bf16w<4>(a, lda, b0, b1, k, c, pf, pf_lines, add); break;
        case 5: fma_bf16w<5>(a, lda, b0, b1, k, c, pf, pf_lines, add); break;
        case 6: fma_bf16w<6>(a, lda, b0, b1, k, c, pf, pf_lines, add); break;
        default: break;
    }
}

#endif

// fp32 rows x [m, k] on a weight packed as bf16 in the bf16 GEMM's layout, with fma_bf16w (the fp32 GEMM's walk: k
// chunks below kChunkRowsUpTo rows), into T out. Two uses: the "avx2_fma" packed ISA's bf16 GEMM (gemm_bf16_fma),
// and "compact" fp32 weights, whose values are all bf16 values (the FMAs and their order are the fp32 GEMM's, so the
// output is the same bit for bit, from half the bytes). 2 where this build has no FMA.
template <typename T>
int gemm_compact(const float* x, int64_t ldx, int64_t m, int64_t k, const bf16* w, int64_t pairs, int64_t n,
                 const T* bias, const T* res, T* out, int64_t ldo, int mode, int nthreads) {
#ifdef KAIROS_PACKED_F32
    if (k % 2 != 0) return 1;
    gemm_walk8<kBf16FmaRows>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads,
                             [](auto... a) { fma_rows_bf16w(a...); });
    return 0;
#else
    return not_built(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads);
#endif
}

// fp32 rows x [m, k] on a grid weight of Bits (above): the fp32 GEMM's walk and kernels on its unpacked panels. 1
// where K is not a multiple of 32, 2 where this build has no FMA.
template <int Bits>
int gemm_grid(const float* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* w, int64_t pairs, int64_t n,
              const float* bias, const float* res, float* out, int64_t ldo, int mode, int nthreads) {
#ifdef KAIROS_PACKED_F32
    if (k % kGridK != 0) return 1;
    auto rows_fn = [](auto... a) { fma_rows(a...); };
    if constexpr (VecWide::W == 8)
        gemm_walk8<kFmaRows, Bits>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads, rows_fn);
    else
        gemm_blocked<kFmaRows, 0, Bits>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads, rows_fn);
    return 0;
#else
    return not_built(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads);
#endif
}

// gemm_packed's bf16 GEMM on the "avx2_fma" packed ISA: x widened to fp32 (exact; the calling thread's scratch),
// then gemm_compact; the epilogue rounds to bf16 as the other bf16 GEMMs do.
int gemm_bf16_fma(const bf16* x, int64_t ldx, int64_t m, int64_t k, const bf16* w, int64_t pairs, int64_t n,
                  const bf16* bias, const bf16* res, bf16* out, int64_t ldo, int mode, int nthreads) {
    thread_local std::vector<float> xf;
    if (static_cast<int64_t>(xf.size()) < m * k) xf.resize(m * k);
    float* xs = xf.data();
    parallel_rows(m, m * k >= 65536 ? nthreads : 1, [&](int64_t i) {
        for (int64_t j = 0; j < k; ++j) xs[i * k + j] = bf2f(x[i * ldx + j]);
    });
    return gemm_compact(xs, k, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads);
}

// out [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ W^T, W packed as above (fp32) with `pairs` panel pairs;
// 2 where this build has no FMA
int gemm_packed(const float* x, int64_t ldx, int64_t m, int64_t k, const float* w, int64_t pairs, int64_t n,
                const float* bias, const float* res, float* out, int64_t ldo, int mode, int nthreads) {
#ifdef KAIROS_PACKED_F32
    auto rows_fn = [](auto... a) { fma_rows(a...); };
    if constexpr (VecWide::W == 8)
        gemm_walk8<kFmaRows>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads, rows_fn);
    else
        gemm_blocked<kFmaRows, 0>(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads, rows_fn);
    return 0;
#else
    return not_built(x, ldx, m, k, w, pairs, n, bias, res, out, ldo, mode, nthreads);
#endif
}

// A whole decode-only step's decoder layers (Llama / Qwen2 shape, bf16 or fp32, packed weights) in one call: per layer
// rms_norm -> q|k|v GEMM (+ bias) -> RoPE + cache write -> paged decode attention -> o_proj GEMM += h -> rms_norm
// -> silu(gate) * up GEMM -> down GEMM += h. The same kernels as the per-op calls, without a Python round trip
// between them. lp: per layer, kLayerFields int64 (pointers as integers, pair counts); h [n, d] is updated in
// place; scratch holds n x (d + q|k|v width + nh * hd + inter) elements of h's type.
// kFormats: how each of the layer's fp32 weights is packed, 4 bits a weight (WeightFormat) at kQkvShift, kOShift,
// kGateUpShift, kDownShift (0 for bf16 layers).
enum LayerField { kLnIn, kLnPost, kQkvW, kQkvPairs, kQkvB, kOW, kOPairs, kOB, kGateUpW, kGateUpPairs, kDownW,
                  kDownPairs, kKCache, kVCache, kFormats, kLayerFields };
enum WeightFormat { kFmtPacked = 0, kFmtCompact = 1, kFmtGrid4 = 2, kFmtGrid8 = 3 };
enum FormatShift { kQkvShift = 0, kOShift = 4, kGateUpShift = 8, kDownShift = 12 };

// decode_layers' GEMMs: the weight at address w as packed (fp32 rows: fp32, compact, grid4 or grid8, by `format`)
inline int gemm_layer(const bf16* x, int64_t ldx, int64_t m, int64_t k, int64_t w, int, int64_t pairs, int64_t n,
                      const bf16* bias, const bf16* res, bf16* out, int64_t ldo, int mode, int nt) {
    return gemm_packed(x, ldx, m, k, reinterpret_cast<const bf16*>(w), pairs, n, bias, res, out, ldo, mode, nt);
}
inline int gemm_layer(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t w, int format, int64_t pairs,
                      int64_t n, const float* bias, const float* res, float* out, int64_t ldo, int mode, int nt) {
    if (format == kFmtCompact)
        return gemm_compact(x, ldx, m, k, reinterpret_cast<const bf16*>(w), pairs, n, bias, res, out, ldo, mode, nt);
    if (format == kFmtGrid4 || format == kFmtGrid8)
        return (format == kFmtGrid4 ? gemm_grid<4> : gemm_grid<8>)(x, ldx, m, k, reinterpret_cast<const uint8_t*>(w),
                                                                   pairs, n, bias, res, out, ldo, mode, nt);
    return gemm_packed(x, ldx, m, k, reinterpret_cast<const float*>(w), pairs, n, bias, res, out, ldo, mode, nt);
}

// Where decode_layers' time goes, summed over calls while profiling is on (kairos_phase_times).
enum Phase { kPhaseNorm, kPhaseQkv, kPhaseRope, kPhaseAttn, kPhaseO, kPhaseGateUp, kPhaseDown, kPhases };
std::atomic<bool> phase_timing{false};
std::atomic<int64_t> phase_ns[kPhases];

struct PhaseClock {  // laps of the calling thread's work between phases, when phase_timing is on
    bool on = phase_timing.load(std::memory_order_relaxed);
    std::chrono::steady_clock::time_point last = on ? std::chrono::steady_clock::now()
                                                    : std::chrono::steady_clock::time_point{};
    void lap(Phase p) {
        if (!on) return;
        const auto now = std::chrono::steady_clock::now();
        phase_ns[p].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count(),
                              std::memory_order_relaxed);
        last = now;
    }
};

template <typename T>
int decode_layers(int64_t nl, const int64_t* lp, T* h, int64_t n, int64_t d, int64_t nh, int64_t nkv, int64_t hd,
                  int64_t inter, float eps, const T* cos, const T* sin, const int64_t* pos, const int64_t* slots,
                  const int32_t* tables, int64_t max_blocks, const int32_t* lens, int64_t bs, float scale,
                  T* scratch, int nt) {
    const int64_t wq = (nh + 2 * nkv) * hd, wo = nh * hd;
    T* x = scratch;
    T* qkv = x + n * d;
    T* ao = qkv + n * wq;
    T* act = ao + n * wo;
    auto ptr = [](int64_t v) { return reinterpret_cast<T*>(v); };
    PhaseClock clock;
    for (int64_t l = 0; l < nl; ++l) {
        const int64_t* f = lp + l * kLayerFields;
        int rc = 0;
        rms_norm(h, d, ptr(f[kLnIn]), x, n, d, eps, nt);
        clock.lap(kPhaseNorm);
        const int64_t formats = f[kFormats];
        auto format = [formats](FormatShift at) { return static_cast<int>((formats >> at) & 15); };
        rc |= gemm_layer(x, d, n, d, f[kQkvW], format(kQkvShift), f[kQkvPairs], wq, ptr(f[kQkvB]), nullptr, qkv, wq,
                         kPlain, nt);
        clock.lap(kPhaseQkv);
        rope_write(qkv, wq, cos, sin, pos, slots, ptr(f[kKCache]), ptr(f[kVCache]), n, nh, nkv, hd, nt);
        clock.lap(kPhaseRope);
        decode_attn(static_cast<const T*>(qkv), wq, ptr(f[kKCache]), ptr(f[kVCache]), tables, max_blocks, lens,
                    ao, n, nh, nkv, hd, bs, scale, nt);
        clock.lap(kPhaseAttn);
        rc |= gemm_layer(ao, wo, n, wo, f[kOW], format(kOShift), f[kOPairs], d, ptr(f[kOB]), h, h, d, kResidual, nt);
        clock.lap(kPhaseO);
        rms_norm(h, d, ptr(f[kLnPost]), x, n, d, eps, nt);
        clock.lap(kPhaseNorm);
        rc |= gemm_layer(x, d, n, d, f[kGateUpW], format(kGateUpShift), f[kGateUpPairs], inter, nullptr, nullptr, act,
                         inter, kSiluMul, nt);
        clock.lap(kPhaseGateUp);
        rc |= gemm_layer(act, inter, n, inter, f[kDownW], format(kDownShift), f[kDownPairs], d, nullptr, h, h, d,
                         kResidual, nt);
        clock.lap(kPhaseDown);
        if (rc != 0) return rc;
    }
    return 0;
}

int packed_gemm_enable() {  // the PackedIsa gemm_packed will run; Linux gives a process AMX's state only on request
    int isa = kIsaNone;
#ifdef KAIROS_PACKED_F32
    isa = kIsaAvx2Fma;
#endif
#ifdef KAIROS_AVX512_BF16
    isa = kIsaAvx512Bf16;
#endif
#ifdef KAIROS_AMX
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0) isa = kIsaAmx;
#endif
    packed_isa.store(isa);
    return isa;
}

int packed_gemm_granted = -1;  // what packed_gemm_enable found, once

}  // namespace

extern "C" {

int kairos_abi_version() { return 10; }

void kairos_sample_rows(int dtype, const void* logits, int64_t ld, const int64_t* rows, int64_t n, int64_t width,
                        const float* temp, const int64_t* top_k, const float* top_p, const float* u, int64_t* out,
                        int nthreads) {
    if (dtype == 1)
        sample_rows(static_cast<const bf16*>(logits), ld, rows, n, width, temp, top_k, top_p, u, out, nthreads);
    else
        sample_rows(static_cast<const float*>(logits), ld, rows, n, width, temp, top_k, top_p, u, out, nthreads);
}

void kairos_argmax_rows(int dtype, const void* x, int64_t row_stride, int64_t n, int64_t width, int64_t* out,
                        int nthreads) {
    if (dtype == 1)
        argmax_rows(static_cast<const bf16*>(x), row_stride, n, width, out, nthreads);
    else
        argmax_rows(static_cast<const float*>(x), row_stride, n, width, out, nthreads);
}

// dtype: 0 = float32, 1 = bfloat16
void kairos_rms_norm(int dtype, const void* x, int64_t x_stride, const void* w, void* y, int64_t n, int64_t d,
                     float eps, int nthreads) {
    if (dtype == 1)
        rms_norm(static_cast<const bf16*>(x), x_stride, static_cast<const bf16*>(w), static_cast<bf16*>(y), n, d, eps,
                 nthreads);
    else
        rms_norm(static_cast<const float*>(x), x_stride, static_cast<const float*>(w), static_cast<float*>(y), n, d,
                 eps, nthreads);
}

void kairos_rope_write(int dtype, void* qkv, int64_t row_stride, const void* cos, const void* sin, const int64_t* pos,
                       const int64_t* slots, void* kc, void* vc, int64_t n, int64_t nh, int64_t nkv, int64_t hd,
                       int nthreads) {
    if (dtype == 1)
        rope_write(static_cast<bf16*>(qkv), row_stride, static_cast<const bf16*>(cos), static_cast<const bf16*>(sin),
                   pos, slots, static_cast<bf16*>(kc), static_cast<bf16*>(vc), n, nh, nkv, hd, nthreads);
    else
        rope_write(static_cast<float*>(qkv), row_stride, static_cast<const float*>(cos), static_cast<const float*>(sin),
                   pos, slots, static_cast<float*>(kc), static_cast<float*>(vc), n, nh, nkv, hd, nthreads);
}

void kairos_decode_attn(int dtype, const void* q, int64_t q_stride, const void* kc, const void* vc,
                        const int32_t* tables, int64_t max_blocks, const int32_t* ctx, void* out, int64_t n,
                        int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float scale, int nthreads) {
    if (dtype == 1)
        decode_attn(static_cast<const bf16*>(q), q_stride, static_cast<const bf16*>(kc), static_cast<const bf16*>(vc),
                    tables, max_blocks, ctx, static_cast<bf16*>(out), n, nh, nkv, hd, bs, scale, nthreads);
    else
        decode_attn(static_cast<const float*>(q), q_stride, static_cast<const float*>(kc),
                    static_cast<const float*>(vc), tables, max_blocks, ctx, static_cast<float*>(out), n, nh, nkv, hd,
                    bs, scale, nthreads);
}

// dtype: 0 = fp32 rows and weight, 1 = bf16, 2 = fp32 rows on a compact weight, 3 / 4 = on a grid4 / grid8 weight.
// gemm: 0 on success; bf16: 1 = K not a multiple of 32, 2 = neither AMX nor AVX512-BF16 (kairos_packed_gemm_enable);
// fp32 (all of 0, 2, 3, 4): 2 = built without FMA (kairos_packed_f32); compact: 1 = K odd; grid: 1 = K not a
// multiple of 32
int kairos_gemm_packed(int dtype, const void* x, int64_t ldx, int64_t m, int64_t k, const void* w, int64_t pairs,
                       int64_t n, const void* bias, const void* res, void* out, int64_t ldo, int mode, int nthreads) {
    if (dtype == 1)
        return gemm_packed(static_cast<const bf16*>(x), ldx, m, k, static_cast<const bf16*>(w), pairs, n,
                           static_cast<const bf16*>(bias), static_cast<const bf16*>(res), static_cast<bf16*>(out), ldo,
                           mode, nthreads);
    if (dtype == 3 || dtype == 4)  // fp32 rows, grid4 / grid8 weight
        return (dtype == 3 ? gemm_grid<4> : gemm_grid<8>)(static_cast<const float*>(x), ldx, m, k,
                                                          static_cast<const uint8_t*>(w), pairs, n,
                                                          static_cast<const float*>(bias),
                                                          static_cast<const float*>(res), static_cast<float*>(out), ldo,
                                                          mode, nthreads);
    if (dtype == 2)  // fp32 rows, compact weight
        return gemm_compact(static_cast<const float*>(x), ldx, m, k, static_cast<const bf16*>(w), pairs, n,
                            static_cast<const float*>(bias), static_cast<const float*>(res), static_cast<float*>(out),
                            ldo, mode, nthreads);
    return gemm_packed(static_cast<const float*>(x), ldx, m, k, static_cast<const float*>(w), pairs, n,
                       static_cast<const float*>(bias), static_cast<const float*>(res), static_cast<float*>(out), ldo,
                       mode, nthreads);
}

// whether this build runs the fp32 packed GEMM (AVX2 or AVX-512 with FMA)
int kairos_packed_f32() {
#ifdef KAIROS_PACKED_F32
    return 1;
#else
    return 0;
#endif
}

// the PackedIsa the packed GEMM runs from now on: the one asked for if this CPU and OS have it, else their best
int kairos_packed_gemm_enable(int want) {
    if (packed_gemm_granted < 0) packed_gemm_granted = packed_gemm_enable();
    const int isa = want >= kIsaNone && want <= packed_gemm_granted ? want : packed_gemm_granted;
    packed_isa.store(isa);
    return isa;
}

// on: parallel loops run on the team; worker_nice: the nice value its workers take (Team::kInheritNice: the caller's)
void kairos_set_team(int on, int worker_nice) {
    Team::get().set_worker_nice(worker_nice);
    use_team.store(on != 0);
}

int kairos_layer_fields() { return kLayerFields; }

// w [n, k] fp32 (k a multiple of 32) on a grid of `bits` (4 or 8)? 1: d, m [n, k / 32] and q [n, k / 32, 32] (uint8
// for 4 bits, int8 for 8) hold it; 0: not; -1: this build cannot search (no F16C)
int kairos_grid_find(const float* w, int64_t n, int64_t k, int bits, float* d, float* m, void* q, int nthreads) {
    if (k % kGridK != 0) return 0;
    if (bits == 4) return grid_find<4>(w, n, k, d, m, static_cast<uint8_t*>(q), nthreads);
    if (bits == 8) return grid_find<8>(w, n, k, d, m, static_cast<int8_t*>(q), nthreads);
    return 0;
}

// on 1: decode_layers sums its phases' wall time from now on, from zero; 0: no longer; -1: as it was. out (if not
// null) gets the kPhases sums so far in ns; returns kPhases
int kairos_phase_times(int on, int64_t* out) {
    if (out != nullptr)
        for (int p = 0; p < kPhases; ++p) out[p] = phase_ns[p].load();
    if (on > 0)
        for (auto& t : phase_ns) t.store(0);
    if (on >= 0) phase_timing.store(on != 0);
    return kPhases;
}

int kairos_decode_layers(int dtype, int64_t nl, const int64_t* lp, void* h, int64_t n, int64_t d, int64_t nh,
                         int64_t nkv, int64_t hd, int64_t inter, float eps, const void* cos, const void* sin,
                         const int64_t* pos, const int64_t* slots, const int32_t* tables, int64_t max_blocks,
                         const int32_t* lens, int64_t bs, float scale, void* scratch, int nthreads) {
    if (dtype == 1)
        return decode_layers(nl, lp, static_cast<bf16*>(h), n, d, nh, nkv, hd, inter, eps,
                             static_cast<const bf16*>(cos), static_cast<const bf16*>(sin), pos, slots, tables,
                             max_blocks, lens, bs, scale, static_cast<bf16*>(scratch), nthreads);
    return decode_layers(nl, lp, static_cast<float*>(h), n, d, nh, nkv, hd, inter, eps, static_cast<const float*>(cos),
                         static_cast<const float*>(sin), pos, slots, tables, max_blocks, lens, bs, scale,
                         static_cast<float*>(scratch), nthreads);
}

}  // extern "C"
