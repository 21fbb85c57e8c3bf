// The depth-bounded suffix trie of suffix_tree.py, compiled: the same nodes, counts, ids and choices (ties
// included) as its Python class, which is the reference and the fallback where nothing compiles. Adding a
// token makes up to max_depth nodes: ~12 us a token in Python, ~1.2 here; with 8 sequences served at once
// (SmolLM2, AMD Zen 5) the Python tries took ~3% of the engine's time.
//
// A node's children keep their insertion order (a Python dict's: a removed child that comes back goes last),
// because "the first most frequent child" is what a chain takes where its best child must be looked up again:
// each node links its children in that order. A child is found by walking those links, or, under a node with
// many children (those near the root), in one open-addressing table of (node, token) -> child. Nothing is
// allocated per node, and a new node's parent (the previous token's path, made just before) is in cache.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <queue>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t kRoot = 0;
constexpr int32_t kNone = -1;
constexpr int32_t kIndexFrom = 8;  // children past which a node's are found in the table
// Bytes a node costs (its count, best, links, token and child count, 32 bytes, plus the vectors' doubling slack;
// the few nodes in the child table cost a little more): the process's resident memory grew 56 and 40 bytes a
// node over tries of 100 and 300 text-like sequences of 400 tokens (1.1M and 3.3M nodes; the Python class:
// 281). ``nbytes`` is this estimate, not a measurement.
constexpr int64_t kNodeBytes = 56;

// (node, token) -> child: linear probing, deletion by backward shift (no tombstones), at most half full.
class ChildTable {
 public:
  ChildTable() : keys_(kStart, kEmpty), children_(kStart, kNone) {}

  int32_t get(int32_t node, int32_t token) const {
    const uint64_t k = key(node, token);
    for (size_t i = slot(k);; i = (i + 1) & mask()) {
      if (keys_[i] == k) return children_[i];
      if (keys_[i] == kEmpty) return kNone;
    }
  }

  void put(int32_t node, int32_t token, int32_t child) {  // (node, token) must be absent
    if (2 * (size_ + 1) > keys_.size()) resize(2 * keys_.size());
    place(key(node, token), child);
  }

  void erase(int32_t node, int32_t token) {  // (node, token) must be present
    const uint64_t k = key(node, token);
    size_t hole = slot(k);
    while (keys_[hole] != k) hole = (hole + 1) & mask();
    for (size_t j = (hole + 1) & mask(); keys_[j] != kEmpty; j = (j + 1) & mask()) {
      const size_t home = slot(keys_[j]);  // j's entry may fill the hole unless its home lies in (hole, j]
      const bool between = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!between) {
        keys_[hole] = keys_[j];
        children_[hole] = children_[j];
        hole = j;
      }
    }
    keys_[hole] = kEmpty;
    children_[hole] = kNone;
    --size_;
  }

  size_t capacity() const { return keys_.size(); }

 private:
  static constexpr size_t kStart = 64;
  static constexpr uint64_t kEmpty = ~0ULL;  // never a key: node ids are below 2^31

  static uint64_t key(int32_t node, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(node)) << 32) | static_cast<uint32_t>(token);
  }
  size_t mask() const { return keys_.size() - 1; }
  size_t slot(uint64_t k) const {  // a 64-bit mix (MurmurHash3's finalizer): ids and tokens are small integers
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return static_cast<size_t>(k) & mask();
  }
  void place(uint64_t k, int32_t child) {
    size_t i = slot(k);
    while (keys_[i] != kEmpty) i = (i + 1) & mask();
    keys_[i] = k;
    children_[i] = child;
    ++size_;
  }
  void resize(size_t capacity) {
    std::vector<uint64_t> keys(capacity, kEmpty);
    std::vector<int32_t> children(capacity, kNone);
    keys.swap(keys_);
    children.swap(children_);
    size_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != kEmpty) place(keys[i], children[i]);
  }

  std::vector<uint64_t> keys_;
  std::vector<int32_t> children_;
  size_t size_ = 0;
};

class SuffixTrie {
 public:
  explicit SuffixTrie(int max_depth) : max_depth_(max_depth) {
    if (max_depth < 1)
      throw py::value_error("a suffix trie needs max_depth >= 1, got " + std::to_string(max_depth));
    append_node();
  }

  int max_depth() const { return max_depth_; }
  int64_t nodes() const { return static_cast<int64_t>(counts_.size()) - 1 - static_cast<int64_t>(free_.size()); }
  int64_t nbytes() const { return nodes() * kNodeBytes; }
  int64_t allocated() const { return static_cast<int64_t>(counts_.size()); }
  int64_t node_count(int32_t node) const { return counts_.at(node); }
  bool has_children(int32_t node) const { return first_.at(node) != kNone; }

  int64_t deepest(const std::vector<int32_t>& path, int64_t more_than) const {
    size_t lo = 0, hi = path.size();  // counts never grow along a path: the first at or below more_than, by halves
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (counts_.at(path[mid]) > more_than) lo = mid + 1; else hi = mid;
    }
    return static_cast<int64_t>(lo) - 1;
  }

  std::vector<int64_t> counts_along(const std::vector<int32_t>& path) const {
    std::vector<int64_t> out;
    out.reserve(path.size());
    for (int32_t node : path) out.push_back(counts_.at(node));
    return out;
  }

  std::vector<int32_t> extend(const std::vector<int32_t>& path, int32_t token) {
    std::vector<int32_t> out;
    extend_into(path, token, out);
    return out;
  }

  std::vector<int32_t> extend_all(std::vector<int32_t> path, const std::vector<int32_t>& tokens) {
    std::vector<int32_t> next;
    for (int32_t token : tokens) {
      extend_into(path, token, next);
      path.swap(next);
    }
    return path;
  }

  void insert(const std::vector<int32_t>& tokens) { extend_all({kRoot}, tokens); }

  void remove(const std::vector<int32_t>& tokens) {
    counts_[kRoot] -= static_cast<int64_t>(tokens.size());
    for (size_t start = 0; start < tokens.size(); ++start) {
      int32_t node = kRoot;
      const size_t end = std::min(tokens.size(), start + static_cast<size_t>(max_depth_));
      for (size_t i = start; i < end; ++i) {
        const int32_t token = tokens[i];
        const int32_t child = child_of(node, token);
        if (child == kNone) throw py::key_error(std::to_string(token));
        counts_[child] -= 1;
        if (best_[node] == token) best_[node] = kNone;  // (another child may count more now)
        if (counts_[child] == 0) {  // (and so will every node below it on this suffix)
          unlink(node, child);
          free_.push_back(child);
        }
        node = child;
      }
    }
  }

  std::vector<int32_t> advance(const std::vector<int32_t>& path, int32_t token) const {
    std::vector<int32_t> out{kRoot};
    for (int32_t node : path) {
      check(node);
      const int32_t child = child_of(node, token);
      if (child == kNone) break;  // a longer tail cannot occur where a shorter one does not
      out.push_back(child);
    }
    return out;
  }

  std::vector<int32_t> advance_all(std::vector<int32_t> path, const std::vector<int32_t>& tokens) const {
    for (int32_t token : tokens) path = advance(path, token);
    return path;
  }

  std::vector<int32_t> match(const std::vector<int32_t>& tokens) const {
    const size_t from = tokens.size() > static_cast<size_t>(max_depth_) ? tokens.size() - max_depth_ : 0;
    return advance_all({kRoot}, std::vector<int32_t>(tokens.begin() + from, tokens.end()));
  }

  int64_t count(const std::vector<int32_t>& tokens) const {
    int32_t node = kRoot;
    for (int32_t token : tokens) {
      node = child_of(node, token);
      if (node == kNone) return 0;
    }
    return counts_[node];
  }

  std::pair<std::vector<int32_t>, std::vector<double>> chain(int32_t node, int64_t budget, double min_prob,
                                                               std::optional<int64_t> base) {
    check(node);
    std::vector<int32_t> tokens;
    std::vector<double> probs;
    double prob = 1.0;
    int64_t total = base ? *base : counts_[node];
    while (static_cast<int64_t>(tokens.size()) < budget && first_[node] != kNone) {
      int32_t token = best_[node];
      if (token == kNone) token = best_[node] = most_frequent(node);
      const int32_t child = child_of(node, token);
      if (total == 0) zero_total();
      prob *= static_cast<double>(counts_[child]) / static_cast<double>(total);
      if (prob < min_prob) break;
      tokens.push_back(token);
      probs.push_back(prob);
      node = child;
      total = counts_[child];
    }
    return {tokens, probs};
  }

  std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>> tree(
      int32_t node, int64_t budget, double min_prob, std::optional<int64_t> base) const {
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs;
    // (-prob, child, token, parent's index): Python's heapq order, smallest first
    using Entry = std::tuple<double, int32_t, int32_t, int32_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    auto push = [&](int32_t parent, double prob, int64_t total, int32_t index) {
      for (int32_t child = first_[parent]; child != kNone; child = next_[child]) {
        if (total == 0) zero_total();
        const double p = prob * static_cast<double>(counts_[child]) / static_cast<double>(total);
        if (p >= min_prob) heap.emplace(-p, child, token_[child], index);
      }
    };
    check(node);
    push(node, 1.0, base ? *base : counts_[node], -1);
    while (!heap.empty() && static_cast<int64_t>(tokens.size()) < budget) {
      const auto [neg, child, token, parent] = heap.top();
      heap.pop();
      tokens.push_back(token);
      parents.push_back(parent);
      probs.push_back(-neg);
      push(child, -neg, counts_[child], static_cast<int32_t>(tokens.size()) - 1);
    }
    return {tokens, parents, probs};
  }

  // The best-scoring continuation of path's tails of at least `shortest` tokens that scores above `floor`, or none
  // (suffix_tree.py's ``pick``: the same loop, in one call instead of a Python call per tail).
  using Pick = std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>, int64_t, int64_t, double>;
  std::optional<Pick> pick(const std::vector<int32_t>& path, int64_t own, int64_t budget, int64_t shortest,
                           double alpha, double min_prob, bool as_tree, double floor) {
    for (int32_t node : path) check(node);
    std::optional<Pick> out;
    for (int64_t d = deepest(path, own); d >= shortest; --d) {
      const int64_t count = counts_[path[d]] - own;
      const int64_t room = std::min({budget, static_cast<int64_t>(std::ceil(alpha * static_cast<double>(d))),
                                     static_cast<int64_t>(max_depth_) - d});
      if (count < 1 || room < 1 || room <= floor) continue;  // (a token's probability is at most 1)
      std::vector<int32_t> tokens, parents;
      std::vector<double> probs;
      if (as_tree) {
        std::tie(tokens, parents, probs) = tree(path[d], room, min_prob, count);
      } else {
        std::tie(tokens, probs) = chain(path[d], room, min_prob, count);
      }
      double score = 0.0;
      for (double p : probs) score += p;  // (left to right, as the Python class adds them)
      if (score > floor) {
        floor = score;
        out = Pick{std::move(tokens), std::move(parents), std::move(probs), d, count, score};
      }
    }
    return out;
  }

 private:
  [[noreturn]] static void zero_total() {  // where Python divides by a count of 0
    PyErr_SetString(PyExc_ZeroDivisionError, "division by zero: no occurrences to divide by");
    throw py::error_already_set();
  }

  void check(int32_t node) const {
    if (node < 0 || static_cast<size_t>(node) >= counts_.size())
      throw py::index_error("no node " + std::to_string(node) + " in this trie");
  }

  void extend_into(const std::vector<int32_t>& path, int32_t token, std::vector<int32_t>& out) {
    const size_t tails = std::min(path.size(), static_cast<size_t>(max_depth_));
    for (size_t i = 0; i < tails; ++i) check(path[i]);  // (a path is the caller's: a bad id is an error, not UB)
    counts_[kRoot] += 1;
    out.assign(1, kRoot);
    for (size_t i = 0; i < tails; ++i) {
      const int32_t node = path[i];
      if (first_[node] == kNone) best_[node] = token;
      const int32_t child = child_of(node, token);
      if (child == kNone) {  // a new substring: so is every longer one ending here
        for (size_t j = i; j < tails; ++j) grow(path[j], token, out);
        return;
      }
      counts_[child] += 1;
      const int32_t b = best_[node];
      if (b != kNone && counts_[child] >= counts_[child_of(node, b)]) best_[node] = token;
      out.push_back(child);
    }
  }

  void grow(int32_t node, int32_t token, std::vector<int32_t>& out) {
    if (first_[node] == kNone) best_[node] = token;
    const int32_t child = new_node();
    link(node, child, token);
    counts_[child] = 1;
    const int32_t b = best_[node];
    if (b != kNone && counts_[child_of(node, b)] <= 1) best_[node] = token;  // ties go to the latest seen
    out.push_back(child);
  }

  int32_t new_node() {
    if (!free_.empty()) {
      const int32_t node = free_.back();
      free_.pop_back();
      best_[node] = kNone;
      return node;
    }
    return append_node();
  }

  int32_t append_node() {
    if (counts_.size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max()))
      throw py::value_error("a suffix trie holds fewer than 2^31 nodes");
    counts_.push_back(0);
    best_.push_back(kNone);
    first_.push_back(kNone);
    last_.push_back(kNone);
    next_.push_back(kNone);
    token_.push_back(kNone);
    kids_.push_back(0);
    return static_cast<int32_t>(counts_.size()) - 1;
  }

  int32_t child_of(int32_t node, int32_t token) const {
    if (kids_[node] > kIndexFrom) return table_.get(node, token);
    for (int32_t child = first_[node]; child != kNone; child = next_[child])
      if (token_[child] == token) return child;
    return kNone;
  }

  void link(int32_t parent, int32_t child, int32_t token) {  // last among its siblings
    token_[child] = token;
    next_[child] = kNone;
    if (first_[parent] == kNone) {
      first_[parent] = child;
    } else {
      next_[last_[parent]] = child;
    }
    last_[parent] = child;
    if (++kids_[parent] == kIndexFrom + 1) {  // from now on in the table, the earlier children too
      for (int32_t c = first_[parent]; c != kNone; c = next_[c]) table_.put(parent, token_[c], c);
    } else if (kids_[parent] > kIndexFrom) {
      table_.put(parent, token, child);
    }
  }

  void unlink(int32_t parent, int32_t child) {
    int32_t before = kNone;
    for (int32_t c = first_[parent]; c != child; c = next_[c]) before = c;
    (before == kNone ? first_[parent] : next_[before]) = next_[child];
    if (last_[parent] == child) last_[parent] = before;
    if (kids_[parent] > kIndexFrom) {
      table_.erase(parent, token_[child]);
      if (kids_[parent] == kIndexFrom + 1)  // back to walking its links: out of the table
        for (int32_t c = first_[parent]; c != kNone; c = next_[c]) table_.erase(parent, token_[c]);
    }
    --kids_[parent];
  }

  int32_t most_frequent(int32_t node) const {  // the first of the most frequent children, in insertion order
    int32_t token = kNone;
    int64_t most = -1;
    for (int32_t child = first_[node]; child != kNone; child = next_[child]) {
      if (counts_[child] > most) {
        most = counts_[child];
        token = token_[child];
      }
    }
    return token;
  }

  int max_depth_;
  std::vector<int64_t> counts_;  // node -> occurrences of its substring; the root's: tokens inserted
  std::vector<int32_t> best_;  // node -> its most frequent child's token; -1 while unknown
  std::vector<int32_t> first_, last_;  // node -> its first and last child (-1: none)
  std::vector<int32_t> next_;  // node -> its next sibling
  std::vector<int32_t> token_;  // node -> the token from its parent
  std::vector<int32_t> kids_;  // node -> its children
  ChildTable table_;
  std::vector<int32_t> free_;  // removed nodes, reused first (last freed first)
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SuffixTrie>(m, "SuffixTrie")
      .def(py::init<int>(), py::arg("max_depth") = 32)
      .def_property_readonly("max_depth", &SuffixTrie::max_depth)
      .def_property_readonly("nodes", &SuffixTrie::nodes)
      .def_property_readonly("nbytes", &SuffixTrie::nbytes)
      .def_property_readonly("node_bytes", [](const SuffixTrie&) { return kNodeBytes; })
      .def_property_readonly("allocated", &SuffixTrie::allocated)
      .def("node_count", &SuffixTrie::node_count)
      .def("has_children", &SuffixTrie::has_children)
      .def("counts_along", &SuffixTrie::counts_along)
      .def("deepest", &SuffixTrie::deepest)
      .def("extend", &SuffixTrie::extend)
      .def("extend_all", &SuffixTrie::extend_all)
      .def("insert", &SuffixTrie::insert)
      .def("remove", &SuffixTrie::remove)
      .def("advance", &SuffixTrie::advance)
      .def("advance_all", &SuffixTrie::advance_all)
      .def("match", &SuffixTrie::match)
      .def("count", &SuffixTrie::count)
      .def("chain", &SuffixTrie::chain, py::arg("node"), py::arg("budget"), py::arg("min_prob") = 0.0,
           py::arg("base") = py::none())
      .def("pick", &SuffixTrie::pick, py::arg("path"), py::arg("own"), py::arg("budget"), py::arg("shortest"),
           py::arg("alpha"), py::arg("min_prob"), py::arg("tree"), py::arg("floor"))
      .def("tree", &SuffixTrie::tree, py::arg("node"), py::arg("budget"), py::arg("min_prob") = 0.0,
           py::arg("base") = py::none());
}
