// See pickle_scan.h. The records, costs and checks follow zerofast/load/pickle_bounds.py line
// for line, so that whatever this pass lets through, the Python pass lets through too: the
// native reader must never accept a file the Python reader refuses.
#include "pickle_scan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "opcodes.h"

namespace zerofast::load {
namespace {

constexpr int32_t kMaxScanDepth = 100;
constexpr int64_t kCap = int64_t(1) << 40;  // costs saturate here, as in the Python pass
constexpr int32_t kScalar = 0;              // the one record all scalars share; never updated
constexpr int32_t kEmptyTuple = 1;          // immutable, like the tuple: shared

// Both arguments are at most a few kCap: their sum cannot overflow.
int64_t sat(int64_t a, int64_t b) { return std::min(a + b, kCap); }

struct Rec {  // 32 bytes: a 20k-tensor pickle makes about 200k of them
  int64_t cost;       // to hash the object
  int64_t item_cost;  // to hash each of its items
  int32_t depth;
  uint32_t items_at;
  uint32_t items_len;
  bool tuple;         // tuples keep their items' records (a callee iterating them)
};

static_assert(sizeof(Rec) == 32, "Rec grew: the pass holds one per object");

Rec rec(int32_t depth, int64_t cost, int64_t item_cost, bool tuple = false, uint32_t at = 0, uint32_t len = 0) {
  return Rec{cost, item_cost, depth, at, len, tuple};
}

// Records taken off the stack, without a vector of their own: nearly every op takes a MARK's
// worth or two, and this pass used to allocate one for each.
struct Span {
  const int32_t* p;
  size_t n;
  const int32_t* begin() const { return p; }
  const int32_t* end() const { return p + n; }
  size_t size() const { return n; }
  int32_t operator[](size_t i) const { return p[i]; }
};

class Scan {
 public:
  Scan(const uint8_t* data, size_t n) : data_(data), n_(n), budget_(8 * int64_t(n) + (int64_t(1) << 20)) {
    recs_.push_back(rec(0, 1, 0));
    recs_.push_back(rec(1, 1, 0, true));
  }

  ScanFacts run() {
    while (pos_ < n_) {
      uint8_t op = data_[pos_++];
      if (op == STOP) {
        if (pos_ != n_) throw Declined("bytes after STOP");
        return facts();
      }
      step(op);
    }
    throw Declined("no STOP");
  }

 private:
  const uint8_t* data_;
  size_t n_;
  size_t pos_ = 0;
  int64_t budget_;
  std::vector<Rec> recs_;
  std::vector<int32_t> items_;  // the tuples' item records, back to back
  std::vector<int32_t> stack_, memo_;
  std::vector<uint8_t> fetched_;  // per memo index: whether a GET reads it
  std::vector<int32_t> marked_;   // see pop_mark
  std::vector<size_t> marks_;
  size_t tuples_ = 0, tuple_items_ = 0, calls_ = 0, dict_items_ = 0;

  ScanFacts facts() const {
    ScanFacts f;
    f.memo_slot.resize(memo_.size(), -1);
    for (size_t i = 0; i < memo_.size(); ++i) {
      if (!fetched_[i]) continue;
      if (f.memo_slots == INT32_MAX) throw Declined("too many memo indices read");
      f.memo_slot[i] = f.memo_slots++;
    }
    f.tuples = tuples_;
    f.tuple_items = tuple_items_;
    f.calls = calls_;
    f.dict_items = dict_items_;
    return f;
  }

  size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  const uint8_t* take(size_t width) {
    if (width > n_ - pos_) throw Declined("truncated");
    const uint8_t* at = data_ + pos_;
    pos_ += width;
    return at;
  }
  int32_t pop() {
    if (stack_.size() <= fence()) throw Declined("stack underflow");
    int32_t r = stack_.back();
    stack_.pop_back();
    return r;
  }
  int32_t top() const {
    if (stack_.size() <= fence()) throw Declined("stack underflow");
    return stack_.back();
  }
  // The records since the last MARK, taken off the stack: in `marked_`, valid until the next
  // call (no op takes two MARKs' worth).
  Span pop_mark() {
    if (marks_.empty()) throw Declined("no MARK");
    size_t start = marks_.back();
    marks_.pop_back();
    marked_.assign(stack_.begin() + ptrdiff_t(start), stack_.end());
    stack_.resize(start);
    return Span{marked_.data(), marked_.size()};
  }
  void charge(int64_t cost) {
    budget_ -= cost;
    if (budget_ < 0) throw Declined("hash work over budget");
  }
  int64_t costs(Span rs, size_t from = 0, size_t step = 1) const {
    int64_t total = 0;
    for (size_t i = from; i < rs.size(); i += step) total = sat(total, recs_[rs[i]].cost);
    return total;
  }
  int32_t depth_of(Span rs) const {
    int32_t d = 0;
    for (int32_t r : rs) d = std::max(d, recs_[r].depth);
    if (d + 1 > kMaxScanDepth) throw Declined("nesting");
    return d + 1;
  }
  int32_t push_rec(const Rec& r) {
    if (recs_.size() >= INT32_MAX) throw Declined("too many objects");
    recs_.push_back(r);
    return int32_t(recs_.size() - 1);
  }
  int32_t container(Span rs) { return push_rec(rec(depth_of(rs), 1, costs(rs))); }
  int32_t tuple_of(Span rs) {
    int32_t d = 0;
    for (int32_t r : rs) d = std::max(d, recs_[r].depth);
    if (d >= kMaxScanDepth) throw Declined("nesting");
    int64_t cost = sat(1, costs(rs));
    uint32_t at = uint32_t(items_.size());
    items_.insert(items_.end(), rs.begin(), rs.end());
    ++tuples_;
    tuple_items_ += rs.size();
    return push_rec(rec(d + 1, cost, cost - 1, true, at, uint32_t(rs.size())));
  }
  int64_t reach(int32_t r) const {  // _reach: hashing r, its items, and its items' items
    const Rec& rec = recs_[r];
    int64_t total = sat(rec.cost, rec.item_cost);
    if (rec.tuple)
      for (uint32_t i = 0; i < rec.items_len; ++i) {
        const Rec& item = recs_[items_[rec.items_at + i]];
        total = sat(total, sat(item.cost, item.item_cost));
      }
    return total;
  }
  void add(int32_t target, Span rs, int64_t key_cost) {
    charge(key_cost);
    if (target == kScalar || recs_[target].tuple) return;
    int32_t d = depth_of(rs);
    Rec& t = recs_[target];
    t.depth = std::max(t.depth, d);
    t.item_cost = sat(t.item_cost, costs(rs));
  }
  int32_t call(Span parts) {
    int64_t total = 0, cost = 1;
    int32_t d = 0;
    for (int32_t r : parts) {
      total = sat(total, reach(r));
      cost = sat(cost, recs_[r].cost);
      d = std::max(d, recs_[r].depth);
    }
    if (d >= kMaxScanDepth) throw Declined("nesting");
    charge(total);
    return push_rec(rec(d + 1, cost, total));
  }
  void put(uint64_t index) {
    if (index > memo_.size()) throw Declined("memo index runs ahead");
    int32_t value = top();
    if (index == memo_.size()) {
      memo_.push_back(value);
      fetched_.push_back(0);
    } else {
      memo_[index] = value;
    }
  }
  void get(uint64_t index) {
    if (index >= memo_.size()) throw Declined("memo value not found");
    fetched_[index] = 1;
    stack_.push_back(memo_[index]);
  }
  void line() {
    const void* nl = std::memchr(data_ + pos_, '\n', n_ - pos_);
    if (!nl) throw Declined("truncated line");
    pos_ = static_cast<const uint8_t*>(nl) - data_ + 1;
  }
  void sized(int width) {
    uint64_t length = little(take(width), width);
    if (length > n_ - pos_) throw Declined("truncated");
    pos_ += length;
    stack_.push_back(kScalar);
  }
  void tuple_n(int k) {
    int32_t rs[3];
    for (int i = k - 1; i >= 0; --i) rs[i] = pop();
    stack_.push_back(tuple_of(Span{rs, size_t(k)}));
  }
  void step(uint8_t op);
  void step_containers(uint8_t op);
};

void Scan::step(uint8_t op) {
  switch (op) {
    case BININT: take(4); stack_.push_back(kScalar); return;
    case BININT1: take(1); stack_.push_back(kScalar); return;
    case BININT2: take(2); stack_.push_back(kScalar); return;
    case BINFLOAT: take(8); stack_.push_back(kScalar); return;
    case NONE: case NEWTRUE: case NEWFALSE: stack_.push_back(kScalar); return;
    case BINPUT: put(little(take(1), 1)); return;
    case LONG_BINPUT: put(little(take(4), 4)); return;
    case MEMOIZE: put(memo_.size()); return;
    case BINGET: get(little(take(1), 1)); return;
    case LONG_BINGET: get(little(take(4), 4)); return;
    case MARK: marks_.push_back(stack_.size()); return;
    case BINUNICODE: case BINBYTES: sized(4); return;
    case SHORT_BINUNICODE: case SHORT_BINBYTES: case LONG1: sized(1); return;
    case BINUNICODE8: case BINBYTES8: sized(8); return;
    case EMPTY_TUPLE: stack_.push_back(kEmptyTuple); return;
    case TUPLE: stack_.push_back(tuple_of(pop_mark())); return;
    case TUPLE1: case TUPLE2: case TUPLE3: tuple_n(op - TUPLE1 + 1); return;
    case REDUCE: case NEWOBJ: {
      int32_t parts[2];
      parts[1] = pop();
      parts[0] = pop();
      ++calls_;
      stack_.push_back(call(Span{parts, 2}));
      return;
    }
    case BINPERSID: pop(); stack_.push_back(kScalar); return;
    case GLOBAL: line(); line(); stack_.push_back(kScalar); return;
    case STACK_GLOBAL: pop(); pop(); stack_.push_back(kScalar); return;
    case POP:
      if (!stack_.empty() && stack_.size() > fence()) stack_.pop_back();
      else if (!marks_.empty()) pop_mark();
      else throw Declined("stack underflow");
      return;
    case POP_MARK: pop_mark(); return;
    case DUP: stack_.push_back(top()); return;
    case PROTO: take(1); return;
    case FRAME: take(8); return;  // a length; the opcodes inside follow as usual (protocol 4)
    default: step_containers(op);
  }
}

void Scan::step_containers(uint8_t op) {
  switch (op) {
    case EMPTY_LIST: case EMPTY_DICT: case EMPTY_SET: stack_.push_back(push_rec(rec(1, 1, 0))); return;
    case APPEND: {
      int32_t item = pop();
      add(top(), Span{&item, 1}, 0);
      return;
    }
    case APPENDS: {
      auto rs = pop_mark();
      add(top(), rs, 0);
      return;
    }
    case SETITEM: {
      int32_t kv[2];
      kv[1] = pop();
      kv[0] = pop();
      ++dict_items_;
      add(top(), Span{kv, 2}, recs_[kv[0]].cost);
      return;
    }
    case SETITEMS: {
      auto rs = pop_mark();
      dict_items_ += rs.size() / 2;
      add(top(), rs, costs(rs, 0, 2));
      return;
    }
    case ADDITEMS: {
      auto rs = pop_mark();
      add(top(), rs, costs(rs));
      return;
    }
    case LIST: stack_.push_back(container(pop_mark())); return;
    case DICT: {
      auto rs = pop_mark();
      charge(costs(rs, 0, 2));
      stack_.push_back(container(rs));
      return;
    }
    case FROZENSET: {  // its hash combines its members' stored hashes, no recursion
      auto rs = pop_mark();
      charge(costs(rs));
      int32_t r = container(rs);
      recs_[r].cost = 1 + int64_t(rs.size());
      ++tuples_;  // the unpickler makes its members a native tuple first
      tuple_items_ += rs.size();
      stack_.push_back(r);
      return;
    }
    case BUILD: {  // the state goes into the instance on the stack
      int32_t state = pop();
      int32_t inst = top();
      charge(reach(state));
      add(inst, Span{&state, 1}, 0);
      return;
    }
    default: throw Declined("opcode outside the native subset");
  }
}

}  // namespace

ScanFacts scan_pickle(const uint8_t* data, size_t size) {
  if (size > (size_t(1) << 36)) throw Declined("pickle too large for the cost arithmetic");
  return Scan(data, size).run();
}

}  // namespace zerofast::load
