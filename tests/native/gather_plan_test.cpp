// Runs csrc/cuda/gather_plan.h on the CPU against a model of the CUDA kernels, on random problems.
//
// The model follows the kernels' contract: a block per span, moving `n` units from `src` to `dst`.
// A cast here reads signed little-endian integers of `from_size` bytes and writes them as
// `to_size` bytes, a stand-in conversion that keeps every value traceable to its element. The
// staging slots are filled with junk before each batch, so a piece that reads bytes its batch did
// not copy shows up as a wrong result. Prints "ok" and exits 0, or says what broke and exits 1.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "gather_plan.h"

using namespace zerofast::cuda;

namespace {

int64_t load(const char* p, int64_t size) {
  uint64_t raw = 0;
  std::memcpy(&raw, p, static_cast<size_t>(size));
  const int shift = static_cast<int>(64 - 8 * size);
  return static_cast<int64_t>(raw << shift) >> shift;
}

void store(char* p, int64_t size, int64_t v) { std::memcpy(p, &v, static_cast<size_t>(size)); }

bool fail(const char* what, uint64_t seed) {
  std::printf("seed %llu: %s\n", static_cast<unsigned long long>(seed), what);
  return false;
}

bool run_table(const Table& t, const Kind& k, uint64_t seed) {
  for (const Span& s : t.spans) {
    if (s.n <= 0 || s.n > kSpanUnits) return fail("span length out of range", seed);
    const char* src = static_cast<const char*>(s.src);
    char* dst = static_cast<char*>(s.dst);
    if (k.casts) {
      for (int64_t i = 0; i < s.n; ++i) store(dst + i * k.to_size, k.to_size, load(src + i * k.from_size, k.from_size));
      continue;
    }
    const auto word = static_cast<uintptr_t>(t.word_bytes);
    if (reinterpret_cast<uintptr_t>(src) % word || reinterpret_cast<uintptr_t>(dst) % word) {
      return fail("copy word not aligned", seed);
    }
    std::memcpy(dst, src, static_cast<size_t>(s.n) * word);
  }
  return true;
}

struct Problem {
  Kind kind;
  std::vector<std::vector<char>> sources;
  std::vector<Piece> pieces;
  std::vector<char> out;
  std::vector<char> expected;
};

Problem make_problem(std::mt19937_64& rng) {
  const int64_t sizes[] = {1, 2, 4, 8};
  auto below = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  Problem p;
  const bool casts = below(2) == 1;
  const int64_t from = sizes[below(4)];
  int64_t to = from;
  while (casts && to == from) to = sizes[below(4)];
  p.kind = {from, to, casts};
  for (int64_t i = 0, n = 1 + below(4); i < n; ++i) {
    std::vector<char> s(static_cast<size_t>((below(4) == 0 ? below(60000) : below(3000)) * from));
    for (char& c : s) c = static_cast<char>(rng());
    p.sources.push_back(std::move(s));
  }
  struct Run { size_t source; int64_t off, dst, n; };
  std::vector<Run> runs;
  int64_t end = below(5);
  for (int64_t i = 0, n = below(40); i < n; ++i) {
    const size_t src = static_cast<size_t>(below(static_cast<int64_t>(p.sources.size())));
    const int64_t numel = static_cast<int64_t>(p.sources[src].size()) / from;
    const int64_t off = below(numel + 1);
    const int64_t len = below(numel - off + 1);
    runs.push_back({src, off, end, len});
    end += len + below(4);
  }
  p.out.assign(static_cast<size_t>(end * to), static_cast<char>(0xAB));
  p.expected = p.out;
  for (const Run& r : runs) {
    const char* s = p.sources[r.source].data() + r.off * from;
    for (int64_t i = 0; i < r.n; ++i) store(p.expected.data() + (r.dst + i) * to, to, load(s + i * from, from));
  }
  std::shuffle(runs.begin(), runs.end(), rng);
  for (const Run& r : runs) {
    p.pieces.push_back({p.sources[r.source].data() + r.off * from, p.out.data() + r.dst * to, r.n});
  }
  return p;
}

bool check_resident(Problem& p, uint64_t seed) {
  if (!run_table(make_table(p.pieces, p.kind), p.kind, seed)) return false;
  return p.out == p.expected || fail("resident gather differs", seed);
}

bool check_staged(Problem& p, const Sizing& sizing, int64_t max_pieces, uint64_t seed) {
  std::vector<std::vector<char>> slots(static_cast<size_t>(sizing.slots));
  std::vector<char*> data;
  for (auto& s : slots) {
    s.resize(static_cast<size_t>(sizing.slot_bytes + kStageAlign));
    const auto base = reinterpret_cast<uintptr_t>(s.data());
    data.push_back(s.data() + (kStageAlign - base % kStageAlign) % kStageAlign);
  }
  bool ok = true;
  int want_slot = 0;
  auto send = [&](const Batch& b) {
    if (!ok) return;
    if (b.slot != want_slot) ok = fail("slots not used in turn", seed);
    want_slot = (want_slot + 1) % sizing.slots;
    if (b.used > sizing.slot_bytes || b.pieces.empty()) ok = fail("batch overflows its slot or is empty", seed);
    if (static_cast<int64_t>(b.pieces.size()) > max_pieces) ok = fail("too many pieces in a batch", seed);
    char* slot = data[static_cast<size_t>(b.slot)];
    std::memset(slot, 0xCD, static_cast<size_t>(sizing.slot_bytes));
    for (const StagedCopy& c : b.copies) {
      if (c.offset % kStageAlign || c.offset + c.bytes > b.used) ok = fail("copy outside the batch", seed);
      std::memcpy(slot + c.offset, c.src, static_cast<size_t>(c.bytes));
    }
    const Table t = make_table(placed(b, slot), p.kind);
    if (static_cast<int64_t>(t.spans.size()) > table_capacity(sizing.slot_bytes, max_pieces)) {
      ok = fail("span table over its capacity", seed);
    }
    ok = ok && run_table(t, p.kind, seed);
  };
  Packer packer(sizing, p.kind, max_pieces);
  for (const Piece& piece : p.pieces) packer.add(piece, send);
  packer.finish(send);
  return ok && (p.out == p.expected || fail("staged gather differs", seed));
}

// Pieces point into their problem's own buffers, so each check gets a fresh copy of the problem.
Problem problem(uint64_t seed) {
  std::mt19937_64 rng(seed);
  return make_problem(rng);
}

bool check(uint64_t seed) {
  Problem resident = problem(seed), staged = problem(seed), tiny = problem(seed);
  if (!check_resident(resident, seed)) return false;
  if (!check_staged(staged, size_slots(staged.pieces, staged.kind), kStagePieces, seed)) return false;
  // Tiny slots and batches: many trips, pieces split across slots, every slot reused.
  std::mt19937_64 rng(~seed);
  const int slots = 1 + static_cast<int>(rng() % kStageSlots);
  const Sizing sizing{tiny.kind.from_size + static_cast<int64_t>(rng() % 300), slots};
  return check_staged(tiny, sizing, 1 + static_cast<int64_t>(rng() % 6), seed);
}

bool check_words() {
  const bool ok = copy_word_bytes(0) == 16 && copy_word_bytes(48) == 16 && copy_word_bytes(24) == 8 &&
                  copy_word_bytes(12) == 4 && copy_word_bytes(6) == 2 && copy_word_bytes(7) == 1;
  return ok || fail("copy_word_bytes", 0);
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t count = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 2000;
  if (!check_words()) return 1;
  for (uint64_t seed = 0; seed < count; ++seed) {
    if (!check(seed)) return 1;
  }
  std::printf("ok\n");
  return 0;
}
