// embedding.cu (Op::Encoder, Op::EncoderBackward). Forward: bitwise the CPU's
// `encoder_forward` (T(wte·scale + wpe) or T(wte·scale)), with and without learned and packed
// positions. Backward: the linked path (encoder_link_rows, encoder_mark_rows,
// encoder_backward_accumulate) and the naive twin both bitwise the CPU's `encoder_backward`
// (each element from its stored value, its rows' scale·dout added in row order in f32,
// rounded once; the positions' gradient with scale 1), with tokens that repeat (one very
// often), every row one token, none repeating, packed positions; for each storage type and
// several launch shapes (the result must not depend on them); scale 1 (GPT-2, Llama) and
// Gemma's √C (an inexact factor: every product rounds).
//
//     python3 scripts/cuda-emu/run.py scripts/cuda-emu/tests/k1_embedding_test.cpp
#include "emu.h"
#include "../../../src/backend/cuda/kernels/embedding.cu"
#include "k1_util.h"

template <class T>
struct K {
    void (*fwd)(T*, const unsigned*, const unsigned*, const float*, const float*, int, int, int, int,
                float);
    void (*acc)(T*, const T*, const unsigned*, const unsigned*, int, int, int, int, float);
    void (*naive)(T*, const T*, const unsigned*, int, int, int, int, float);
};

// The CPU's scatter: table[key(r)] gets scale·dout[r] in row order, in f32 from its stored
// value, rounded once; only rows that are hit are written.
template <class T>
std::vector<T> ref_scatter(std::vector<T> table, const std::vector<T>& dout,
                           const std::vector<unsigned>& keys, int N, int C, float scale) {
    int rows = (int)(table.size() / C);
    std::vector<std::vector<float>> acc(rows);
    for (int r = 0; r < N; r++) {
        unsigned k = keys[r];
        if (acc[k].empty()) {
            acc[k].resize(C);
            for (int c = 0; c < C; c++) acc[k][c] = to_f32(table[(size_t)k * C + c]);
        }
        for (int c = 0; c < C; c++) acc[k][c] += scale * to_f32(dout[(size_t)r * C + c]);
    }
    for (int k = 0; k < rows; k++)
        if (!acc[k].empty())
            for (int c = 0; c < C; c++) table[(size_t)k * C + c] = from_f32<T>(acc[k][c]);
    return table;
}

// The linked path on keys (NULL: r % T), with a launch shape.
template <class T>
void linked(const K<T>& k, std::vector<T>& table, const std::vector<T>& dout, const unsigned* keys,
            int N, int Tq, int C, int rows, float scale, unsigned lblock, dim3 agrid,
            unsigned ablock) {
    std::vector<unsigned> link(2 * (size_t)N, 0xdeadbeefu);
    emu_launch(encoder_link_rows, dim3(k1::ceil_div(N, lblock)), dim3(lblock), 0, link.data(), keys, N, Tq);
    emu_launch(encoder_mark_rows, dim3(2), dim3(32), 0, link.data(), N);
    emu_launch(k.acc, agrid, dim3(ablock), 0, table.data(), dout.data(), keys,
               (const unsigned*)link.data(), N, Tq, C, rows, scale);
}

template <class T>
void run(const K<T>& k, int B, int Tq, int C, int V, int mode, bool packed, bool learned,
         float scale = 1.0f) {
    int N = B * Tq, maxT = Tq + 3;
    std::vector<unsigned> tokens(N), positions(N);
    std::mt19937 rng(N * 31 + C + mode);
    for (int r = 0; r < N; r++) {
        switch (mode) {
        case 0: tokens[r] = rng() % V; break;                       // random, repeats
        case 1: tokens[r] = (r % 3 == 0) ? 5 % V : rng() % V; break;  // one frequent token
        case 2: tokens[r] = 1 % V; break;                            // all one token
        default: tokens[r] = (unsigned)(r % V); break;                // none repeat (N <= V)
        }
        positions[r] = packed ? (unsigned)((r * 5 + 1) % Tq) : (unsigned)(r % Tq);
    }
    const unsigned* pos = packed ? positions.data() : nullptr;
    auto wte = k1::randn((size_t)V * C, 1.0f, 50 + V);
    auto wpe = k1::randn((size_t)maxT * C, 1.0f, 51 + C);
    char w[160];
    snprintf(w, sizeof w, "%s B%d T%d C%d V%d mode %d packed %d learned %d scale %g", k1::tname<T>(),
             B, Tq, C, V, mode, packed, learned, scale);
    std::string tag(w);

    // Forward.
    std::vector<T> out((size_t)N * C, from_f32<T>(99.0f)), want(out.size());
    for (int r = 0; r < N; r++)
        for (int c = 0; c < C; c++) {
            float e = wte[(size_t)tokens[r] * C + c] * scale;
            if (learned) e = e + wpe[(size_t)positions[r] * C + c];
            want[(size_t)r * C + c] = from_f32<T>(e);
        }
    const dim3 fshapes[] = {dim3(k1::ceil_div((long long)N * C, 256)), dim3(1)};
    for (auto g : fshapes) {
        std::fill(out.begin(), out.end(), from_f32<T>(99.0f));
        emu_launch(k.fwd, g, dim3(g.x == 1 ? 32 : 256), 0, out.data(), (const unsigned*)tokens.data(), pos,
                   (const float*)wte.data(), learned ? (const float*)wpe.data() : nullptr, N, Tq, C, V,
                   scale);
        emu::expect_bits(("encoder_forward " + tag).c_str(), out, want);
    }

    // Backward.
    auto dout = k1::stored<T>(k1::randn((size_t)N * C, 1.0f, 60 + N));
    auto dwte0 = k1::stored<T>(k1::randn((size_t)V * C, 0.5f, 61));
    auto dwpe0 = k1::stored<T>(k1::randn((size_t)maxT * C, 0.5f, 62));
    auto want_wte = ref_scatter(dwte0, dout, tokens, N, C, scale);
    auto want_wpe = ref_scatter(dwpe0, dout, positions, N, C, 1.0f);  // positions: unscaled
    struct Shape { unsigned lblock; dim3 agrid; unsigned ablock; };
    const Shape shapes[] = {{256, dim3(N, k1::ceil_div(C, 256)), 256},
                            {32, dim3(N, k1::ceil_div(C, 32)), 32},
                            {64, dim3(3, 1), 32}};  // grid-stride over rows and channels
    for (auto& s : shapes) {
        std::vector<T> dwte = dwte0, dwpe = dwpe0;
        linked(k, dwte, dout, tokens.data(), N, Tq, C, V, scale, s.lblock, s.agrid, s.ablock);
        if (learned) linked(k, dwpe, dout, pos, N, Tq, C, Tq, 1.0f, s.lblock, s.agrid, s.ablock);
        snprintf(w, sizeof w, "encoder_backward dwte %s link block %u", tag.c_str(), s.lblock);
        emu::expect_bits(w, dwte, want_wte);
        if (learned) {
            snprintf(w, sizeof w, "encoder_backward dwpe %s link block %u", tag.c_str(), s.lblock);
            emu::expect_bits(w, dwpe, want_wpe);
        }
    }
    std::vector<T> dwte = dwte0, dwpe = dwpe0;
    emu_launch(k.naive, dim3(k1::ceil_div((long long)N * C, 64)), dim3(64), 0, dwte.data(),
               (const T*)dout.data(), (const unsigned*)tokens.data(), N, Tq, C, V, scale);
    emu_launch(k.naive, dim3(2), dim3(32), 0, dwpe.data(), (const T*)dout.data(), pos, N, Tq, C, Tq,
               1.0f);
    emu::expect_bits(("encoder_backward_naive dwte " + tag).c_str(), dwte, want_wte);
    emu::expect_bits(("encoder_backward_naive dwpe " + tag).c_str(), dwpe, want_wpe);
}

template <class T>
void all(const K<T>& k) {
    // (B, T, C, V, mode, packed, learned)
    run<T>(k, 1, 1, 1, 1, 0, false, true);
    run<T>(k, 2, 4, 3, 5, 0, false, true);
    run<T>(k, 3, 7, 40, 11, 0, true, true);
    run<T>(k, 2, 150, 33, 50, 1, false, true);   // N = 300: several link tiles
    run<T>(k, 2, 150, 17, 50, 1, true, false);
    run<T>(k, 1, 300, 5, 7, 2, false, false);    // all one token
    run<T>(k, 1, 290, 9, 600, 3, false, true);   // no token repeats: the scan runs to the end
    run<T>(k, 4, 80, 300, 97, 0, false, true);   // C past a block of channels
    // Gemma's √C (here √640 = 25.298..., inexact), with and without positions.
    const float sqrt_c = sqrtf(640.0f);
    run<T>(k, 2, 4, 3, 5, 0, false, true, sqrt_c);
    run<T>(k, 3, 7, 40, 11, 0, true, true, sqrt_c);
    run<T>(k, 2, 150, 33, 50, 1, false, false, sqrt_c);  // repeats: several scaled terms a row
    run<T>(k, 1, 300, 5, 7, 2, false, false, sqrt_c);    // all one token
}

int main() {
    all<float>({encoder_forward_f32, encoder_backward_accumulate_f32, encoder_backward_naive_f32});
    all<bf16>({encoder_forward_bf16, encoder_backward_accumulate_bf16, encoder_backward_naive_bf16});
    all<f16>({encoder_forward_f16, encoder_backward_accumulate_f16, encoder_backward_naive_f16});
    // A token past the vocabulary: a NaN row forward, ignored backward (the CPU panics).
    std::vector<unsigned> tok = {0, 9, 1};
    std::vector<float> wte = {1, 2, 3, 4}, out(6, 0.0f);
    emu_launch(encoder_forward_f32, dim3(1), dim3(32), 0, out.data(), (const unsigned*)tok.data(),
               (const unsigned*)nullptr, (const float*)wte.data(), (const float*)nullptr, 3, 3, 2, 2,
               1.0f);
    EMU_CHECK(out[0] == 1 && out[1] == 2 && std::isnan(out[2]) && std::isnan(out[3]) &&
                  out[4] == 3 && out[5] == 4,
              "encoder_forward with a bad token");
    return emu::finish();
}
