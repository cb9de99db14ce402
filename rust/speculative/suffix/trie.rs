//! `SuffixTrie`: every suffix of a set of token streams, cut at `max_depth` tokens, with the
//! number of times each string occurs.
//!
//! A node stands for one string `w` of at most `max_depth` tokens that occurs in a stream;
//! its `count` is the number of positions where `w` occurs across the streams. So the
//! empirical probability that `w` is followed by `t` is `count(w t) / count(w)`. Each node
//! keeps a suffix link (the node of `w` without its first token), which exists because a
//! suffix of an occurring string occurs too; the links give every shorter match in one step
//! each and let a pattern be matched in one pass.
//!
//! The trie is uncompressed (one node per string), which keeps every count exact and makes
//! taking a token back the exact inverse of adding it, at the price of up to `max_depth`
//! nodes per stored token; callers bound what they store.
//!
//! Invariants: the trie holds exactly the strings of length `1..=max_depth` that occur in
//! the streams appended and not popped, each with its occurrence count (no node has count
//! 0); `link(v)` is the node of `v`'s string without its first token (the root for depth 1);
//! a node's cached `best` child is either unknown (`DIRTY`) or the child with the highest
//! count, ties going to the smaller token id.

use rustc_hash::FxHashMap;

/// The root: the empty string.
pub(crate) const ROOT: u32 = 0;
/// No node (an empty child list, the end of a list, the root's link).
const NONE: u32 = u32::MAX;
/// A `best` child that must be found again by scanning the children.
const DIRTY: u32 = u32::MAX - 1;
/// Node ids stay below this; callers keep the node count under it.
pub(crate) const MAX_NODES: usize = (u32::MAX - 2) as usize;

#[derive(Clone, Copy, Debug)]
struct Node {
    /// The last token of the node's string.
    token: u32,
    /// Occurrences of the node's string across the streams.
    count: u32,
    /// The node of the string without its first token.
    link: u32,
    first_child: u32,
    next_sibling: u32,
    prev_sibling: u32,
    /// The most frequent child, `NONE` without children, `DIRTY` when unknown.
    best: u32,
}

impl Node {
    fn new(token: u32, link: u32) -> Self {
        Node {
            token,
            count: 0,
            link,
            first_child: NONE,
            next_sibling: NONE,
            prev_sibling: NONE,
            best: NONE,
        }
    }
}

/// Where a stream's newest suffixes end: the node of its last `depth` tokens, `depth` being
/// the stream's length capped at `max_depth - 1` (the longest suffix that can still be
/// continued inside the trie).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub(crate) node: u32,
    pub(crate) depth: usize,
}

impl Cursor {
    /// The cursor of an empty stream.
    pub(crate) const START: Cursor = Cursor {
        node: ROOT,
        depth: 0,
    };
}

/// The suffixes of several token streams, cut at `max_depth`, with occurrence counts.
#[derive(Clone, Debug)]
pub(crate) struct SuffixTrie {
    max_depth: usize,
    /// Slot 0 is the root; freed slots are chained through `next_sibling`.
    nodes: Vec<Node>,
    free_head: u32,
    /// `(parent << 32) | token` to the child: finding a child costs the same at any fan-out.
    edges: FxHashMap<u64, u32>,
    /// Nodes in use, the root excluded.
    live: usize,
    /// The chain of a cursor, reused between calls.
    scratch: Vec<u32>,
}

fn edge(parent: u32, token: u32) -> u64 {
    (u64::from(parent) << 32) | u64::from(token)
}

impl SuffixTrie {
    /// An empty trie keeping strings of up to `max_depth` (at least 2) tokens.
    pub(crate) fn new(max_depth: usize) -> Self {
        SuffixTrie {
            max_depth,
            nodes: vec![Node::new(0, NONE)],
            free_head: NONE,
            edges: FxHashMap::default(),
            live: 0,
            scratch: Vec::new(),
        }
    }

    /// Nodes in use, the root excluded.
    pub(crate) fn live_nodes(&self) -> usize {
        self.live
    }

    /// Bytes held by the node slots and the child table (their capacity, not their use).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.edges.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
            + self.scratch.capacity() * 4
    }

    /// Forgets every stream, keeping the allocations.
    pub(crate) fn clear(&mut self) {
        self.nodes.truncate(1);
        self.nodes[0] = Node::new(0, NONE);
        self.free_head = NONE;
        self.edges.clear();
        self.live = 0;
    }

    /// The child of `node` for `token`, if that string occurs.
    pub(crate) fn child(&self, node: u32, token: u32) -> Option<u32> {
        self.edges.get(&edge(node, token)).copied()
    }

    /// The last token of `node`'s string.
    pub(crate) fn token(&self, node: u32) -> u32 {
        self.nodes[node as usize].token
    }

    /// Occurrences of `node`'s string (for the root: tokens stored).
    pub(crate) fn count(&self, node: u32) -> u32 {
        self.nodes[node as usize].count
    }

    /// The node of `node`'s string without its first token.
    pub(crate) fn link(&self, node: u32) -> u32 {
        self.nodes[node as usize].link
    }

    /// The most frequent child of `node` (ties to the smaller token), if it has children.
    pub(crate) fn best_child(&mut self, node: u32) -> Option<u32> {
        let n = node as usize;
        if self.nodes[n].best == DIRTY {
            let mut best = NONE;
            let mut c = self.nodes[n].first_child;
            while c != NONE {
                if best == NONE || self.beats(c, best) {
                    best = c;
                }
                c = self.nodes[c as usize].next_sibling;
            }
            self.nodes[n].best = best;
        }
        Some(self.nodes[n].best).filter(|&b| b != NONE)
    }

    /// The children of `node`, in no particular order.
    pub(crate) fn children(&self, node: u32) -> impl Iterator<Item = u32> + '_ {
        let first = self.nodes[node as usize].first_child;
        std::iter::successors(Some(first).filter(|&c| c != NONE), move |&c| {
            Some(self.nodes[c as usize].next_sibling).filter(|&n| n != NONE)
        })
    }

    /// Whether child `a` ranks above child `b`: more frequent, or as frequent with a
    /// smaller token.
    fn beats(&self, a: u32, b: u32) -> bool {
        let (a, b) = (&self.nodes[a as usize], &self.nodes[b as usize]);
        a.count > b.count || (a.count == b.count && a.token < b.token)
    }

    /// The cursor's node and every shorter suffix's node, deepest first, in `scratch`.
    fn fill_chain(&mut self, cursor: Cursor) {
        self.scratch.clear();
        let mut node = cursor.node;
        for _ in 0..=cursor.depth {
            self.scratch.push(node);
            node = self.nodes[node as usize].link;
        }
    }

    fn alloc(&mut self, token: u32, link: u32) -> u32 {
        self.live += 1;
        if self.free_head != NONE {
            let id = self.free_head;
            self.free_head = self.nodes[id as usize].next_sibling;
            self.nodes[id as usize] = Node::new(token, link);
            id
        } else {
            self.nodes.push(Node::new(token, link));
            (self.nodes.len() - 1) as u32
        }
    }

    /// One more occurrence of `parent`'s string followed by `token`; returns that child.
    fn add_occurrence(&mut self, parent: u32, token: u32, link: u32) -> u32 {
        let child = match self.child(parent, token) {
            Some(c) => c,
            None => {
                let c = self.alloc(token, link);
                self.edges.insert(edge(parent, token), c);
                let first = self.nodes[parent as usize].first_child;
                self.nodes[c as usize].next_sibling = first;
                if first != NONE {
                    self.nodes[first as usize].prev_sibling = c;
                }
                self.nodes[parent as usize].first_child = c;
                c
            }
        };
        self.nodes[child as usize].count += 1;
        let best = self.nodes[parent as usize].best;
        if best == NONE || (best != DIRTY && best != child && self.beats(child, best)) {
            self.nodes[parent as usize].best = child;
        }
        child
    }

    /// One occurrence fewer of `parent`'s string followed by `token`; the node goes when
    /// it no longer occurs.
    fn remove_occurrence(&mut self, parent: u32, token: u32) {
        let Some(child) = self.child(parent, token) else {
            debug_assert!(false, "removing a string the trie does not hold");
            return;
        };
        let p = parent as usize;
        if self.nodes[p].best == child {
            self.nodes[p].best = DIRTY;
        }
        let c = child as usize;
        self.nodes[c].count -= 1;
        if self.nodes[c].count > 0 {
            return;
        }
        self.edges.remove(&edge(parent, token));
        let (prev, next) = (self.nodes[c].prev_sibling, self.nodes[c].next_sibling);
        if prev == NONE {
            self.nodes[p].first_child = next;
        } else {
            self.nodes[prev as usize].next_sibling = next;
        }
        if next != NONE {
            self.nodes[next as usize].prev_sibling = prev;
        }
        self.nodes[c].next_sibling = self.free_head;
        self.free_head = child;
        self.live -= 1;
    }

    /// Appends `token` to the stream whose cursor is `cursor`; returns its new cursor.
    pub(crate) fn append(&mut self, cursor: Cursor, token: u32) -> Cursor {
        self.fill_chain(cursor);
        self.nodes[ROOT as usize].count += 1;
        // Shortest suffix first, so the node a new node links to already exists.
        let mut shorter = ROOT;
        let mut deepest = ROOT;
        for i in (0..self.scratch.len()).rev() {
            let parent = self.scratch[i];
            deepest = self.add_occurrence(parent, token, shorter);
            shorter = deepest;
        }
        let depth = cursor.depth + 1;
        if depth < self.max_depth {
            Cursor {
                node: deepest,
                depth,
            }
        } else {
            Cursor {
                node: self.link(deepest),
                depth: depth - 1,
            }
        }
    }

    /// The cursor of the stream `tokens`, found from the root.
    pub(crate) fn cursor_of(&self, tokens: &[u32]) -> Cursor {
        let depth = tokens.len().min(self.max_depth - 1);
        let mut node = ROOT;
        for &t in &tokens[tokens.len() - depth..] {
            match self.child(node, t) {
                Some(c) => node = c,
                None => {
                    debug_assert!(false, "a stored stream's suffix is missing");
                    return Cursor::START;
                }
            }
        }
        Cursor { node, depth }
    }

    /// Takes back the last token of a stream: `before` is the cursor of the stream without
    /// it, `token` the token.
    pub(crate) fn pop(&mut self, before: Cursor, token: u32) {
        self.fill_chain(before);
        self.nodes[ROOT as usize].count -= 1;
        // Longest suffix first: a node that no longer occurs goes before the shorter one
        // its link points to.
        for i in 0..self.scratch.len() {
            let parent = self.scratch[i];
            self.remove_occurrence(parent, token);
        }
    }

    /// The longest suffix of `pattern` that the trie holds and can continue (at most
    /// `max_depth - 1` tokens), as a cursor.
    pub(crate) fn longest_suffix(&self, pattern: &[u32]) -> Cursor {
        let mut at = Cursor::START;
        for &t in pattern {
            loop {
                if at.depth + 1 < self.max_depth {
                    if let Some(c) = self.child(at.node, t) {
                        at = Cursor {
                            node: c,
                            depth: at.depth + 1,
                        };
                        break;
                    }
                }
                if at.node == ROOT {
                    break;
                }
                at = Cursor {
                    node: self.link(at.node),
                    depth: at.depth - 1,
                };
            }
        }
        at
    }
}
