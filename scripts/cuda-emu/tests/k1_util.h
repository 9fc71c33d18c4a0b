// Helpers shared by the tests of fill, norm, activation, embedding, rope and bias kernels
// (k1_*_test.cpp): a seeded normal generator, typed buffers of the storage types (converted
// with the prelude's own to_f32/from_f32, so host and kernel round alike), and the type list.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cmath>
#include <random>
#include <vector>

namespace k1 {

inline std::vector<float> randn(size_t n, float scale, uint64_t seed, float shift = 0.0f) {
    std::mt19937_64 r(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = d(r) * scale + shift;
    return v;
}

// x rounded to the storage type T.
template <class T>
inline std::vector<T> stored(const std::vector<float>& x) {
    std::vector<T> v(x.size());
    for (size_t i = 0; i < x.size(); i++) v[i] = from_f32<T>(x[i]);
    return v;
}

template <class T>
inline std::vector<float> widened(const std::vector<T>& x) {
    std::vector<float> v(x.size());
    for (size_t i = 0; i < x.size(); i++) v[i] = to_f32(x[i]);
    return v;
}

// x rounded to T and back (what a T buffer holding x reads as).
template <class T>
inline std::vector<float> through(const std::vector<float>& x) {
    return widened(stored<T>(x));
}

template <class T> inline const char* tname();
template <> inline const char* tname<float>() { return "f32"; }
template <> inline const char* tname<bf16>() { return "bf16"; }
template <> inline const char* tname<f16>() { return "f16"; }

// Relative tolerance of one rounding to T (a couple of ulps).
template <class T> inline double tol();
template <> inline double tol<float>() { return 2e-6; }
template <> inline double tol<bf16>() { return 1.6e-2; }
template <> inline double tol<f16>() { return 2e-3; }

inline unsigned ceil_div(long long a, long long b) { return (unsigned)((a + b - 1) / b); }

}  // namespace k1
