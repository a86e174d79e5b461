// See twin.h.
#include "twin.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
#include <unordered_map>
#include <unordered_set>
#include <memory>

#include "dlpack_tensor.h"
#include "opcodes.h"
#include "pickle_scan.h"
#include "py_own.h"
#include "recipes.h"
#include "restride.h"
#include "torch_kit.h"
#include "zip_directory.h"

namespace py = pybind11;

namespace zerofast::load {
namespace {

// Deeper than the bounds pass lets any pickle nest (100): a tree this deep is not the reader's.
constexpr int kMaxCopyDepth = 200;

// A file mapping (an UntypedStorage): where its bytes start, and how many.
struct FileSpan {
  uintptr_t at;
  int64_t size;
};

FileSpan span_of(PyObject* storage) {
  py::object at = call_method(storage, names().data_ptr);
  py::object size = call_method(storage, names().nbytes);
  return FileSpan{uintptr_t(int64_of(at.ptr(), "data_ptr")), int64_of(size.ptr(), "nbytes")};
}


// Whether `b`'s entries are `a`'s, in order, but for the folder name every torch.save archive
// puts first (each rank file's own stem): the same names after it, sizes and methods, data.pkl
// in the same place (its size may differ: the pickles are compared on their own). Where they
// are, a storage key's lookup (the folder, "/data/", the key, case-insensitively) finds entry i
// in both or in neither, and entry i passes the same checks in both.
bool same_entries(const ZipDirectory& a, const ZipDirectory& b) {
  if (a.entries.size() != b.entries.size()) return false;
  const size_t pa = a.prefix.size(), pb = b.prefix.size();
  for (size_t i = 0; i < a.entries.size(); ++i) {
    const ZipEntry &x = a.entries[i], &y = b.entries[i];
    const std::string_view xn = a.name(i), yn = b.name(i);
    const bool pickle = x.data_offset == a.pickle_offset;
    if (pickle != (y.data_offset == b.pickle_offset) || xn.compare(0, pa, a.prefix) != 0 ||
        yn.compare(0, pb, b.prefix) != 0 || xn.substr(pa) != yn.substr(pb) ||
        x.compressed != y.compressed || (!pickle && (x.stored_size != y.stored_size || x.size != y.size)))
      return false;
  }
  return true;
}

bool same_archive(const ZipDirectory& like, const ZipDirectory& dir) {
  py::gil_scoped_release unlocked;  // compares native entries only
  return same_entries(like, dir);
}

// -- pickles equal but for the storages' locations ------------------------------------------
// torch.save writes each storage's device into its persistent id, ('storage', class, key,
// location, numel): "cuda:<local rank>" on a GPU save, so ranks' pickles differ there alone.
// Both readers ignore the location. Two pickles are the same to them where their opcodes agree
// byte for byte but for strings in that slot, and no later opcode fetches such a string or its
// id tuple from the memo (where it could reach the tree).

struct Token {
  uint8_t op;
  size_t at, len;  // the opcode and its argument: bytes [at, at + len)
};


// The argument's width after the opcode, or -1 for an opcode outside the reader's subset; a
// sized argument (a string) is `width` length bytes plus that many.
int fixed_width(uint8_t op, int* sized) {
  *sized = 0;
  switch (op) {
    case PROTO: case BININT1: case BINPUT: case BINGET: return 1;
    case BININT2: return 2;
    case BININT: case LONG_BINPUT: case LONG_BINGET: return 4;
    case BINFLOAT: return 8;
    case SHORT_BINUNICODE: case SHORT_BINBYTES: case LONG1: *sized = 1; return 0;
    case BINUNICODE: case BINBYTES: *sized = 4; return 0;
    case BINUNICODE8: case BINBYTES8: *sized = 8; return 0;
    case MARK: case EMPTY_TUPLE: case STOP: case POP: case POP_MARK: case DUP: case NONE: case BINPERSID:
    case REDUCE: case EMPTY_LIST: case APPEND: case BUILD: case DICT: case APPENDS: case LIST: case SETITEM:
    case TUPLE: case SETITEMS: case EMPTY_DICT: case NEWOBJ: case TUPLE1: case TUPLE2: case TUPLE3:
    case NEWTRUE: case NEWFALSE: case EMPTY_SET: case ADDITEMS: case FROZENSET: case STACK_GLOBAL: case MEMOIZE:
    case GLOBAL: return 0;
    default: return -1;
  }
}

bool next_token(const uint8_t* d, size_t n, size_t pos, Token* t) {
  if (pos >= n) return false;
  int sized = 0;
  int width = fixed_width(d[pos], &sized);
  if (width < 0) return false;
  size_t len = 1 + size_t(width);
  if (sized) {
    if (n - pos - 1 < size_t(sized)) return false;
    uint64_t size = little(d + pos + 1, sized);
    if (size > n - pos - 1 - size_t(sized)) return false;
    len += size_t(sized) + size_t(size);
  } else if (d[pos] == GLOBAL) {  // two lines
    for (int line = 0; line < 2; ++line) {
      const void* nl = pos + len < n ? std::memchr(d + pos + len, '\n', n - pos - len) : nullptr;
      if (!nl) return false;
      len = static_cast<const uint8_t*>(nl) - (d + pos) + 1;
    }
  }
  if (len > n - pos) return false;
  *t = Token{d[pos], pos, len};
  return true;
}

bool is_text(uint8_t op) { return op == SHORT_BINUNICODE || op == BINUNICODE || op == BINUNICODE8; }
bool is_int(uint8_t op) { return op == BININT || op == BININT1 || op == BININT2 || op == LONG1; }
bool is_put(uint8_t op) { return op == BINPUT || op == LONG_BINPUT; }
bool is_get(uint8_t op) { return op == BINGET || op == LONG_BINGET; }
bool is_value(uint8_t op) {
  return is_text(op) || is_int(op) || is_get(op) || op == GLOBAL || op == NONE || op == NEWTRUE || op == NEWFALSE ||
         op == BINFLOAT;
}
bool closes_mark(uint8_t op) {
  return op == TUPLE || op == LIST || op == DICT || op == FROZENSET || op == APPENDS || op == SETITEMS ||
         op == ADDITEMS || op == POP_MARK;
}

// Walks two pickles in step; see above.
class PickleMatch {
 public:
  bool run(const uint8_t* a, size_t na, const uint8_t* b, size_t nb) {
    size_t pa = 0, pb = 0;
    for (;;) {
      Token x{}, y{};
      if (!next_token(a, na, pa, &x) || !next_token(b, nb, pb, &y)) return false;
      bool equal = x.len == y.len && std::memcmp(a + x.at, b + y.at, x.len) == 0;
      if (!equal && !location(x, y)) return false;
      at_location_ = !equal;
      if (!follow(x, a)) return false;
      pa += x.len;
      pb += y.len;
      if (x.op == STOP) return pa == na && pb == nb;
    }
  }

 private:
  struct Frame {
    int values = 0;
    bool simple = true;  // only single-opcode values (and memo puts) since its MARK
  };
  enum State { kNone, kLocation, kNumel, kTuple, kPersid };
  std::vector<Frame> frames_;
  std::unordered_set<uint64_t> hidden_;  // memo indices no opcode may fetch
  State state_ = kNone;
  bool at_location_ = false;  // the opcodes in step are the two location strings
  bool reliable_ = true;  // POP may drop a MARK: the frames are then not known

  // Strings in the fourth slot of an id tuple that holds only single-opcode values so far.
  bool location(const Token& x, const Token& y) const {
    return reliable_ && state_ == kNone && is_text(x.op) && is_text(y.op) && !frames_.empty() &&
           frames_.back().simple && frames_.back().values == 3;
  }

  bool follow(const Token& t, const uint8_t* data) {
    if (is_get(t.op) && hidden_.count(little(data + t.at + 1, t.op == BINGET ? 1 : 4))) return false;
    if (!step_state(t, data)) return false;
    if (t.op == MARK) {
      frames_.push_back(Frame{});
    } else if (closes_mark(t.op)) {
      if (frames_.empty()) return false;
      frames_.pop_back();
    } else if (t.op == POP) {
      reliable_ = false;
    } else if (!frames_.empty() && !is_put(t.op)) {
      Frame& f = frames_.back();
      if (is_value(t.op)) ++f.values;
      else f.simple = false;
    }
    return true;
  }

  // After a location: an optional memo put (hidden), the numel, TUPLE, an optional memo put
  // (hidden), BINPERSID; anything else and the strings were not a location.
  bool step_state(const Token& t, const uint8_t* data) {
    auto hide = [&] { hidden_.insert(little(data + t.at + 1, t.op == BINPUT ? 1 : 4)); };
    switch (state_) {
      case kNone:
        if (at_location_) state_ = kLocation;
        return true;
      case kLocation:
        if (is_put(t.op)) { hide(); state_ = kNumel; return true; }
        [[fallthrough]];
      case kNumel:
        if (!is_int(t.op)) return false;
        state_ = kTuple;
        return true;
      case kTuple:
        if (t.op != TUPLE) return false;
        state_ = kPersid;
        return true;
      case kPersid:
        if (is_put(t.op)) { hide(); return true; }
        if (t.op != BINPERSID) return false;
        state_ = kNone;
        return true;
    }
    return false;
  }
};

bool same_pickle(const py::bytes& a, const py::bytes& b) {
  const auto* x = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(a.ptr()));
  const auto* y = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(b.ptr()));
  size_t nx = size_t(PyBytes_GET_SIZE(a.ptr())), ny = size_t(PyBytes_GET_SIZE(b.ptr()));
  py::gil_scoped_release unlocked;  // reads bytes only
  if (nx == ny && std::memcmp(x, y, nx) == 0) return true;
  return PickleMatch().run(x, nx, y, ny);
}


// The template's tree again, each tensor cut from `to` where the template's is cut from `from`:
// a whole tree, or parts of it in several calls, which share what they copied (one memo), so
// that parts copied now and the rest copied later are one tree.
class Rebase {
 public:
  using Dir = std::shared_ptr<ZipDirectory>;
  Rebase(const py::object& from, const py::object& to, const Dir& from_dir, const Dir& to_dir,
         const py::tuple& shared, const py::tuple& types, std::shared_ptr<Recipes> recipes)
      : kit_(bound_kit()), recipes_(std::move(recipes)), from_t_(from), to_t_(to), from_(span_of(from.ptr())), to_(to.ptr()),
        to_size_(span_of(to.ptr()).size), to_dir_(to_dir), shared_objects_(shared),
        types_(types) {
    if (!same_entries(*from_dir, *to_dir)) throw Declined("the zip directories differ");
    // Sized for a tree of a few objects per entry: rehashing was a tenth of a copy's time.
    made_.reserve(2 * from_dir->entries.size());
    storages_.reserve(from_dir->entries.size());
    entry_at_.reserve(from_dir->entries.size());
    for (size_t i = 0; i < from_dir->entries.size(); ++i) entry_at_.emplace_back(from_dir->entries[i].data_offset, i);
    if (!std::is_sorted(entry_at_.begin(), entry_at_.end())) std::sort(entry_at_.begin(), entry_at_.end());
    for (const auto& o : shared) shared_.insert(o.ptr());
    if (types.size() != 3) throw std::invalid_argument("rebase: expected (Size, OrderedDict, DeepSpeedRecord)");
    size_type_ = types[0].ptr();
    ordered_dict_ = types[1].ptr();
    record_type_ = types[2].ptr();
  }

  Rebase(const Rebase&) = delete;
  Rebase& operator=(const Rebase&) = delete;

  // The copy of `part` of the template's tree: its tensors first, in batches (premake), then
  // the tree around them.
  py::object copy_part(PyObject* part) {
    walked_.clear();  // also where an earlier call declined midway
    premake(part, 0);
    walked_.clear();
    if (batch_.size()) place(batch_.make());
    return copy(part, 0);
  }

  py::object copy_tensor(PyObject* o) {  // one premake did not reach (a stand-in's attribute)
    py::object made = tensor(o);
    if (made) return remember(o, made);
    place(batch_.make());
    return made_.at(o);
  }

  py::object copy(PyObject* o, int depth) {
    if (leaf(o)) return py::reinterpret_borrow<py::object>(o);
    if (depth > kMaxCopyDepth) throw Declined("nested too deeply");
    auto found = made_.find(o);
    if (found != made_.end()) {
      if (!found->second) throw Declined("a tuple that contains itself");
      return found->second;
    }
    if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(kit_.tensor_type) ||
        Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(kit_.parameter_type))
      return copy_tensor(o);
    if (PyTuple_CheckExact(o)) return immutable(o, depth);
    if (PyList_CheckExact(o)) return list(o, depth);
    if (PyDict_CheckExact(o)) return dict(o, depth);
    if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(ordered_dict_)) return ordered(o, depth);
    if (PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(record_type_))) return record(o, depth);
    throw Declined(std::string("an object the twin reader does not copy: ") + Py_TYPE(o)->tp_name);
  }

 private:
  const TorchKit& kit_;
  std::shared_ptr<Recipes> recipes_;  // what the template's read noted of its tensors, or null
  py::object from_t_, to_t_;  // the two mappings (UntypedStorage), alive while this copies
  FileSpan from_;
  PyObject* to_;
  int64_t to_size_;
  Dir to_dir_;
  py::tuple shared_objects_, types_;
  std::vector<std::pair<int64_t, size_t>> entry_at_;  // the template's (data offset, entry index), sorted
  std::unordered_set<PyObject*> shared_;
  PyObject *size_type_, *ordered_dict_, *record_type_;
  std::unordered_map<PyObject*, py::object> made_;  // template object -> its copy (memo sharing)
  // The template's storages by data address, with their size: the reader cuts one storage per
  // key, at its entry's data, and no two entries' data start at one address.
  struct Copied {  // a template storage's counterpart here
    int64_t size;
    py::object base;     // the tensor the batch makes this storage's others from: the DLPack one
                         // over the whole entry where the first spans it, else one over the entry
    int64_t at;          // the entry's data offset in this file
  };
  std::unordered_map<uintptr_t, Copied> storages_;
  MappingImports imports_{to_};  // the DLPack tensors over `to` (pybind11 deletes the copier with the GIL held)
  RestrideBatch batch_;  // the tensors premake collected, made in one call
  std::vector<PyObject*> pending_;  // their templates, in the batch's order (kept alive by the tree)
  std::unordered_set<PyObject*> walked_;  // what premake has been through this call

  // What the reference makes afresh but nobody can change: shared with the template.
  bool leaf(PyObject* o) const {
    return o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) ||
           PyUnicode_CheckExact(o) || PyBytes_CheckExact(o) ||
           Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(kit_.dtype_type) ||
           Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(size_type_) || shared_.count(o);
  }

  py::object remember(PyObject* o, py::object made) {
    made_[o] = made;
    return made;
  }

  // What the reader never makes declines. Asked through the tensor's Python attributes: this
  // half has no torch headers.
  // Being CPU and strided is not asked: a tensor found over the template's file mapping
  // (counterpart) is both, and any other has no data pointer or one outside it.
  void check_plain(PyObject* o) const {
    const Names& n = names();
    if (get_attr(o, n.requires_grad).ptr() != Py_False || call_method(o, n.is_conj).ptr() != Py_False ||
        call_method(o, n.is_neg).ptr() != Py_False)
      throw Declined("a tensor the reader does not make");
  }

  // The counterpart here of the template storage tensor `o` is over, found once per storage.
  // Where a tensor over the same storage came before, found by where that storage starts (its
  // data less its offset): no storage object is made for the template's other tensors.
  Copied& counterpart(PyObject* o, int64_t offset, int64_t itemsize) {
    const auto data = uintptr_t(int64_of(call_method(o, names().data_ptr).ptr(), "data_ptr"));
    auto seen = storages_.find(data - uintptr_t(offset) * uintptr_t(itemsize));
    if (data && seen != storages_.end()) return seen->second;
    py::object storage = call_method(o, names().untyped_storage);
    const FileSpan s = span_of(storage.ptr());
    if (s.at < from_.at || s.size > from_.size || int64_t(s.at - from_.at) > from_.size - s.size)
      throw Declined("a storage outside the template's mapping");
    auto found = storages_.find(s.at);
    if (found == storages_.end())
      found = storages_.emplace(s.at, Copied{s.size, {}, entry_like(int64_t(s.at - from_.at), s.size)}).first;
    if (found->second.size != s.size) throw Declined("two storages at one address");
    return found->second;
  }

  // The same tensor over this file's storage: made now where it is its storage's first and
  // spans it (one DLPack import), else added to the batch (null returned).
  py::object tensor(PyObject* o) {
    if (const Recipe* r = recipes_ ? recipes_->find(o) : nullptr) return from_recipe(o, *r);
    check_plain(o);
    const Names& n = names();
    py::object dtype_obj = get_attr(o, n.dtype), shape = get_attr(o, n.shape), stride = call_method(o, n.stride);
    const int64_t offset = int64_of(call_method(o, n.storage_offset).ptr(), "storage_offset");
    const DtypeInfo& dtype = dtype_info(dtype_obj.ptr());
    Copied& c = counterpart(o, offset, dtype.itemsize);
    Dims size, step;
    dims_of(shape.ptr(), stride.ptr(), &size, &step);
    return made_or_batched(o, c, dtype, offset, size.size(), size.v, step.v);
  }

  // The same from the recipe of the template's read: no question asked of the tensor.
  py::object from_recipe(PyObject* o, const Recipe& r) {
    const uintptr_t at = from_.at + uintptr_t(r.entry_at);  // where the template's storage starts
    auto found = storages_.find(at);
    if (found == storages_.end())
      found = storages_.emplace(at, Copied{r.nbytes, {}, entry_like(r.entry_at, r.nbytes)}).first;
    return made_or_batched(o, found->second, *r.dtype, r.offset, r.ndim, recipes_->sizes(r),
                           recipes_->strides(r));
  }

  // Made now where it is its storage's first and spans the entry (one DLPack import), else
  // added to the batch as the copy of template `o` (null returned).
  py::object made_or_batched(PyObject* o, Copied& c, const DtypeInfo& dtype, int64_t offset, size_t ndim,
                             const int64_t* size, const int64_t* step) {
    if (!c.base && offset == 0 && dtype.dl) {
      py::object made = whole_entry(c, dtype, ndim, size, step);
      if (made) return made;
    }
    if (!c.base) c.base = whole_storage_tensor(dtype, cut(to_, c.at, c.size).ptr(), c.size / dtype.itemsize);
    batch_.add(c.base.ptr(), offset, ndim, size, step);
    pending_.push_back(o);
    return py::object();
  }

  // The template's tensors under `o`, walked in the order copy() meets them: each not copied yet
  // is made now or joins the batch. What copy() would decline is left to it.
  void premake(PyObject* o, int depth) {
    if (leaf(o) || depth > kMaxCopyDepth || made_.count(o) || !walked_.insert(o).second) return;
    if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(kit_.tensor_type) ||
        Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(kit_.parameter_type)) {
      py::object made = tensor(o);
      if (made) remember(o, made);
      return;
    }
    if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
      py::object items = own(PySequence_Fast(o, "items"), "items");
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items.ptr()); ++i)
        premake(PySequence_Fast_GET_ITEM(items.ptr(), i), depth + 1);
    } else if (PyDict_Check(o)) {  // a dict or an OrderedDict (keys are leaves in any tree read)
      Py_ssize_t i = 0;
      PyObject *k, *v;
      while (PyDict_Next(o, &i, &k, &v)) premake(v, depth + 1);
    }
  }

  // The batch's tensors, in the order premake added them, remembered as their templates' copies.
  void place(const py::object& made) {
    for (size_t i = 0; i < pending_.size(); ++i)
      remember(pending_[i], py::reinterpret_borrow<py::object>(PyList_GET_ITEM(made.ptr(), Py_ssize_t(i))));
    pending_.clear();
  }

  // A template tensor's sizes and strides (checked by torch when it was made).
  static void dims_of(PyObject* shape, PyObject* stride, Dims* size, Dims* step) {
    const Py_ssize_t n = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : -1;
    if (n < 0 || size_t(n) > kMaxDims || !PyTuple_Check(stride) || PyTuple_GET_SIZE(stride) != n)
      throw Declined("a tensor's sizes and strides");
    for (Py_ssize_t i = 0; i < n; ++i) {
      size->v[i] = int64_of(PyTuple_GET_ITEM(shape, i), "size");
      step->v[i] = int64_of(PyTuple_GET_ITEM(stride, i), "stride");
    }
    size->n = step->n = size_t(n);
  }

  // As the unpickler makes a storage's first tensor where it spans the entry (see
  // unpickle.cpp): one DLPack import. Null where the tensor does not span it.
  py::object whole_entry(Copied& c, const DtypeInfo& dtype, size_t n, const int64_t* size, const int64_t* step) {
    __int128 extent = 1;
    for (size_t i = 0; i < n; ++i) {
      if (size[i] < 0 || step[i] < 0) return py::object();
      extent += __int128(size[i] ? size[i] - 1 : 0) * step[i];
    }
    for (size_t i = 0; i < n; ++i)
      if (size[i] == 0) extent = 0;
    if (extent * dtype.itemsize != c.size) return py::object();
    c.base = imports_.tensor(dtype, c.at, n, size, step);
    return c.base;
  }


  // Where the reader cut the storage of the same key from this file: the data offset here of the
  // entry whose data the template's storage starts.
  int64_t entry_like(int64_t offset, int64_t nbytes) {
    auto e = std::lower_bound(entry_at_.begin(), entry_at_.end(), std::make_pair(offset, size_t(0)));
    if (e == entry_at_.end() || e->first != offset) throw Declined("a storage that is no zip entry's data");
    const ZipEntry& here = to_dir_->entries[e->second];
    if (here.size != nbytes || here.data_offset > to_size_ - nbytes) throw Declined("storage size");
    return here.data_offset;
  }

  // Sets are not copied: the same items added again need not iterate in the same order.
  py::object immutable(PyObject* o, int depth) {  // a tuple: its items first
    made_.emplace(o, py::object());  // in progress: met again inside itself, it declines
    py::object items = own(PySequence_Tuple(o), "items");
    Py_ssize_t n = PyTuple_GET_SIZE(items.ptr());
    py::object copies = own(PyTuple_New(n), "tuple");
    bool same = true;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PyTuple_GET_ITEM(items.ptr(), i);
      py::object c = copy(item, depth + 1);
      same = same && c.ptr() == item;
      PyTuple_SET_ITEM(copies.ptr(), i, c.release().ptr());
    }
    return remember(o, same ? py::reinterpret_borrow<py::object>(o) : copies);
  }

  // Whether every value (and key) of a dict is a leaf: then a plain copy of it is the copy.
  bool leaves_only(PyObject* d) const {
    Py_ssize_t i = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &i, &k, &v))
      if (!leaf(k) || !leaf(v)) return false;
    return true;
  }

  bool leaf_items(PyObject* list) const {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i)
      if (!leaf(PyList_GET_ITEM(list, i))) return false;
    return true;
  }

  py::object list(PyObject* o, int depth) {
    if (leaf_items(o)) return remember(o, own(PyList_GetSlice(o, 0, PyList_GET_SIZE(o)), "list"));
    py::object out = remember(o, own(PyList_New(0), "list"));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o); ++i)
      if (PyList_Append(out.ptr(), copy(PyList_GET_ITEM(o, i), depth + 1).ptr()) < 0) own(nullptr, "append");
    return out;
  }

  py::object dict(PyObject* o, int depth) {
    if (leaves_only(o)) return remember(o, own(PyDict_Copy(o), "dict"));
    py::object out = remember(o, own(PyDict_New(), "dict"));
    fill(out.ptr(), o, depth);
    return out;
  }

  // An OrderedDict, and the `_metadata` BUILD put in its __dict__ (a state dict's). Another
  // attribute could hide the methods a copy by name would call (`keys`, `items`): declined,
  // and the file read in full.
  py::object ordered(PyObject* o, int depth) {
    py::object attrs = own(PyObject_GetAttrString(o, "__dict__"), "__dict__");
    Py_ssize_t n = PyDict_GET_SIZE(attrs.ptr());
    if (n > 1 || (n == 1 && !PyDict_GetItemString(attrs.ptr(), "_metadata")))
      throw Declined("an OrderedDict with attributes other than _metadata");
    py::object out;
    if (leaves_only(o)) {  // OrderedDict(o) copies in o's order, several times faster than item by item
      out = remember(o, own(PyObject_CallOneArg(ordered_dict_, o), "OrderedDict"));
    } else {
      out = remember(o, own(PyObject_CallNoArgs(ordered_dict_), "OrderedDict"));
      py::object it = own(PyObject_GetIter(o), "iter");  // the type's iterator: o's own order
      while (PyObject* key = PyIter_Next(it.ptr())) {
        py::object k = py::reinterpret_steal<py::object>(key);
        PyObject* value = PyDict_GetItemWithError(o, key);
        if (!value) own(nullptr, "item");
        if (PyObject_SetItem(out.ptr(), copy(key, depth + 1).ptr(), copy(value, depth + 1).ptr()) < 0)
          own(nullptr, "item");
      }
      if (PyErr_Occurred()) own(nullptr, "iteration");
    }
    attributes(out.ptr(), o, depth);
    return out;
  }

  py::object record(PyObject* o, int depth) {  // a stand-in: its class, and its attributes copied
    auto* type = Py_TYPE(o);
    py::object none = own(PyTuple_New(0), "tuple");
    py::object out = remember(o, own(type->tp_new(type, none.ptr(), nullptr), "stand-in"));
    attributes(out.ptr(), o, depth);
    return out;
  }

  void attributes(PyObject* out, PyObject* o, int depth) {
    py::object from = own(PyObject_GetAttrString(o, "__dict__"), "__dict__");
    if (!PyDict_CheckExact(from.ptr())) throw Declined("__dict__ is not a dict");
    if (PyDict_GET_SIZE(from.ptr()) == 0) return;
    py::object to = own(PyObject_GetAttrString(out, "__dict__"), "__dict__");
    fill(to.ptr(), from.ptr(), depth);
  }

  void fill(PyObject* to, PyObject* from, int depth) {
    Py_ssize_t i = 0;
    PyObject *k, *v;
    while (PyDict_Next(from, &i, &k, &v))
      if (PyDict_SetItem(to, copy(k, depth + 1).ptr(), copy(v, depth + 1).ptr()) < 0) own(nullptr, "item");
  }
};

template <typename F>
py::tuple declining(F&& f) {
  try {
    return py::make_tuple(true, f());
  } catch (const Declined& e) {  // a torch call that failed too: never the file's fault, it is read in full
    return py::make_tuple(false, std::string(e.what()));
  }
}

}  // namespace

void register_twin(py::module_& m) {
  m.def("same_archive", &same_archive, py::arg("like"), py::arg("dir"),
        "Whether zip directory `dir` holds `like`'s entries in order, the same but for the archive's folder name");
  m.def("same_pickle", &same_pickle, py::arg("a"), py::arg("b"),
        "Whether two data.pkl read the same to zerofast's readers: equal, or equal but for the location strings of "
        "storage ids that nothing else refers to");
  py::class_<Rebase>(m, "Twin").def(
      "copy", [](Rebase& r, const py::object& o) { return declining([&] { return r.copy_part(o.ptr()); }); },
      py::arg("tree"),
      "(True, copy) of a part of the template's tree, sharing what earlier calls copied; (False, why) where it "
      "holds what the copy does not know");
  m.def(
      "twin",
      [](const py::object& from, const py::object& to, const Rebase::Dir& from_dir, const Rebase::Dir& to_dir,
         const py::tuple& shared, const py::tuple& types, std::shared_ptr<Recipes> recipes) {
        return declining([&] { return py::cast(new Rebase(from, to, from_dir, to_dir, shared, types, recipes),
                                               py::return_value_policy::take_ownership); });
      },
      py::arg("from"), py::arg("to"), py::arg("from_dir"), py::arg("to_dir"), py::arg("shared"), py::arg("types"),
      py::arg("recipes").none(true) = py::none(),
      "(True, Twin): copies of the tree read from mapping `from` (directory `from_dir`), each storage cut from `to` "
      "where `to_dir` puts the same entry, each tensor made from its recipe where `recipes` (the template read's, "
      "unpickle(recipes=True)) has one; (False, why)");
}

}  // namespace zerofast::load
