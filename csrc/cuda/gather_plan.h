// How a gather is cut into GPU work, in plain C++17: no torch and no CUDA here.
//
// The glue (gather_cast_cuda.cpp) drives the GPU with these pieces; tests/native/gather_plan_test.cpp
// runs the same code on the CPU against a model of the kernels. That is how CI checks the slot
// packing and the span tables without a GPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace zerofast {
namespace cuda {

// One thread block's work: `n` units read from `src` and written to `dst`, both on the device.
// A unit is one element for a cast and one word for a copy (see copy_word_bytes).
struct Span {
  const void* src;
  void* dst;
  int64_t n;
};

// Runs are cut into spans of at most this many units, so that one long tensor spreads over the
// whole GPU and every block does about the same amount of work.
constexpr int64_t kSpanUnits = 8192;

// The widest copy word (16, 8, 4, 2 or 1 bytes) dividing `bits`, the OR of every address and byte
// count of a copy: whole tensors move 16 bytes at a time while an odd offset still works.
inline int copy_word_bytes(uint64_t bits) {
  int word = 16;
  while (word > 1 && bits % static_cast<uint64_t>(word) != 0) word /= 2;
  return word;
}

// Appends the spans of one run of `n` units; unit sizes are in bytes on each side.
inline void append_spans(std::vector<Span>& spans, const void* src, void* dst, int64_t n, int64_t src_unit,
                         int64_t dst_unit) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (int64_t done = 0; done < n; done += kSpanUnits) {
    spans.push_back({s + done * src_unit, d + done * dst_unit, std::min(kSpanUnits, n - done)});
  }
}

// `n` elements from `src` to `dst`.
struct Piece {
  const char* src;
  char* dst;
  int64_t n;
};

// What one launch does: element sizes in bytes, and whether it converts (else from == to).
struct Kind {
  int64_t from_size;
  int64_t to_size;
  bool casts;
};

struct Table {
  std::vector<Span> spans;
  int word_bytes = 0;  // copies only
};

inline Table make_table(const std::vector<Piece>& pieces, const Kind& kind) {
  Table t;
  if (kind.casts) {
    for (const Piece& p : pieces) append_spans(t.spans, p.src, p.dst, p.n, kind.from_size, kind.to_size);
    return t;
  }
  uint64_t bits = 0;
  for (const Piece& p : pieces) {
    bits |= reinterpret_cast<uintptr_t>(p.src) | reinterpret_cast<uintptr_t>(p.dst) |
            static_cast<uint64_t>(p.n * kind.from_size);
  }
  t.word_bytes = copy_word_bytes(bits);
  for (const Piece& p : pieces) {
    append_spans(t.spans, p.src, p.dst, p.n * kind.from_size / t.word_bytes, t.word_bytes, t.word_bytes);
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Host sources cross to the GPU through a few staging slots, used in turn. A batch is what one
// slot carries in one trip: host ranges copied into the slot's data, and the pieces the kernel
// then reads from there. Offsets are into the slot's data, so the same batch serves its pinned
// host half and its device half.

constexpr int64_t kStageAlign = 16;  // the widest copy word
constexpr int kStageSlots = 3;  // one being packed, one uploading, one being read by a kernel
constexpr int64_t kStageSlotBytes = 32 << 20;
constexpr int64_t kStagePieces = 4096;  // per batch, which bounds the span table

struct StagedCopy {
  const char* src;
  int64_t offset;
  int64_t bytes;
};

struct StagedPiece {
  int64_t offset;
  char* dst;
  int64_t n;
};

struct Batch {
  int slot = 0;
  int64_t used = 0;  // bytes of the slot's data
  std::vector<StagedCopy> copies;
  std::vector<StagedPiece> pieces;
};

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// The batch's pieces reading from `data`, where this slot's data lies.
inline std::vector<Piece> placed(const Batch& b, const char* data) {
  std::vector<Piece> pieces;
  pieces.reserve(b.pieces.size());
  for (const StagedPiece& p : b.pieces) pieces.push_back({data + p.offset, p.dst, p.n});
  return pieces;
}

// Spans one batch can need: a cut every kSpanUnits bytes of data (one-byte words at worst), plus
// one ragged end per piece.
inline int64_t table_capacity(int64_t slot_bytes, int64_t max_pieces) {
  return slot_bytes / kSpanUnits + max_pieces;
}

struct Sizing {
  int64_t slot_bytes;
  int slots;
};

// Small calls, which most tensors are, get small slots; the allocators cache what they hand out.
inline Sizing size_slots(const std::vector<Piece>& pieces, const Kind& kind) {
  int64_t total = 0;
  for (const Piece& p : pieces) total += round_up(p.n * kind.from_size, kStageAlign);
  const int64_t slot_bytes = std::max(kStageAlign, std::min(total, kStageSlotBytes));
  const int64_t trips = (total + slot_bytes - 1) / slot_bytes;
  return {slot_bytes, static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kStageSlots, trips)))};
}

class Packer {
 public:
  Packer(const Sizing& sizing, const Kind& kind, int64_t max_pieces)
      : sizing_(sizing), kind_(kind), max_pieces_(max_pieces) {
    if (sizing.slot_bytes < kind.from_size || sizing.slots < 1 || max_pieces < 1) {
      throw std::invalid_argument("zerofast: staging slots too small for one element");
    }
  }

  // Packs `p`, handing each batch that fills a slot to `send(const Batch&)`.
  template <typename Send>
  void add(Piece p, Send&& send) {
    while (p.n > 0) {
      const int64_t at = round_up(open_.used, kStageAlign);
      const int64_t fits = (sizing_.slot_bytes - std::min(at, sizing_.slot_bytes)) / kind_.from_size;
      if (fits == 0 || static_cast<int64_t>(open_.pieces.size()) == max_pieces_) {
        next(send);
        continue;
      }
      const int64_t take = std::min(p.n, fits);
      const int64_t bytes = take * kind_.from_size;
      open_.copies.push_back({p.src, at, bytes});
      open_.pieces.push_back({at, p.dst, take});
      open_.used = at + bytes;
      p.src += bytes;
      p.dst += take * kind_.to_size;
      p.n -= take;
    }
  }

  template <typename Send>
  void finish(Send&& send) {
    if (!open_.pieces.empty()) next(send);
  }

 private:
  template <typename Send>
  void next(Send& send) {
    send(static_cast<const Batch&>(open_));
    const int slot = (open_.slot + 1) % sizing_.slots;
    open_ = Batch{};
    open_.slot = slot;
  }

  const Sizing sizing_;
  const Kind kind_;
  const int64_t max_pieces_;
  Batch open_;
};

}  // namespace cuda
}  // namespace zerofast
