//! The crate's layering, checked from its source: the sidecar side (everything outside
//! `operator/` and the operator's binary) never names the operator, and no two files import each
//! other, directly or around a longer circle. A reference is a `crate::…` or `super::…` path in
//! a file's code (a `use`, a qualified call; not a comment or doc link), resolved to the file
//! that defines the module it lands in.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, by path relative to `src/`.
fn sources(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(root).expect("under src");
            let text = std::fs::read_to_string(&path).expect("read source");
            out.insert(rel.to_string_lossy().replace('\\', "/"), text);
        }
    }
}

/// The module path of a source file: `owner/handoff.rs` → `owner::handoff`, `etcd/mod.rs` →
/// `etcd`, `lib.rs` → the crate root (empty).
fn module_of(file: &str) -> Vec<String> {
    let trimmed = file.trim_end_matches(".rs");
    let mut parts: Vec<String> = trimmed.split('/').map(str::to_string).collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Paths starting with `head::` in `text`, as module segments (identifiers only; stops at
/// `{`, `*` or anything else).
fn paths_after<'a>(text: &'a str, head: &str) -> impl Iterator<Item = Vec<String>> + 'a {
    let needle = format!("{head}::");
    let mut at = 0;
    std::iter::from_fn(move || {
        loop {
            let found = text[at..].find(&needle)? + at;
            at = found + needle.len();
            // A longer identifier ending in `head` (e.g. `my_crate::`) is not this path.
            let before = text[..found].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let rest = &text[at..];
            let mut segs = Vec::new();
            for seg in rest.split("::") {
                let ident: String = seg
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if ident.is_empty() {
                    break;
                }
                let whole = ident.len() == seg.len();
                segs.push(ident);
                if !whole {
                    break;
                }
            }
            return Some(segs);
        }
    })
}

/// The source files each file refers to (by `crate::` and `super::` paths), itself excluded.
fn graph(files: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeMap<Vec<String>, String> =
        files.keys().map(|f| (module_of(f), f.clone())).collect();
    // The file defining the longest module prefix of `path`.
    let resolve = |path: &[String]| -> Option<String> {
        (1..=path.len())
            .rev()
            .find_map(|n| modules.get(&path[..n]).cloned())
    };
    let mut g = BTreeMap::new();
    for (file, text) in files {
        let me = module_of(file);
        // `super` of a file's module: its parent (for `a/b.rs` and `a/b/mod.rs` alike, `a`).
        let parent: Vec<String> = me[..me.len().saturating_sub(1)].to_vec();
        let mut refs = BTreeSet::new();
        for segs in paths_after(text, "crate") {
            if let Some(f) = resolve(&segs) {
                refs.insert(f);
            }
        }
        for segs in paths_after(text, "super") {
            // `super::super::x` climbs twice.
            let mut base = parent.clone();
            let mut rest = segs.as_slice();
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
            let full: Vec<String> = base.iter().chain(rest).cloned().collect();
            if let Some(f) = resolve(&full) {
                refs.insert(f);
            }
        }
        refs.remove(file);
        g.insert(file.clone(), refs);
    }
    g
}

fn src() -> (PathBuf, BTreeMap<String, String>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    sources(&root, &root, &mut files);
    // This file names what it looks for.
    files.remove("boundaries.rs");
    for text in files.values_mut() {
        // Tests inside a file (its `mod tests`) may reach anywhere; only the code counts.
        if let Some(i) = text.find("#[cfg(test)]\nmod tests") {
            text.truncate(i);
        }
        // Comments and doc links are no imports.
        *text = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
    }
    (root, files)
}

#[test]
fn nothing_outside_the_operator_names_the_operator() {
    let (_, files) = src();
    let g = graph(&files);
    let operator_side = |f: &str| f.starts_with("operator/") || f == "bin/etcd-warden-operator.rs";
    let crossings: Vec<String> = g
        .iter()
        .filter(|(f, _)| !operator_side(f) && f.as_str() != "lib.rs")
        .flat_map(|(f, refs)| {
            refs.iter()
                .filter(|r| r.starts_with("operator/"))
                .map(move |r| format!("{f} -> {r}"))
        })
        .collect();
    assert!(crossings.is_empty(), "{crossings:#?}");
    // The binary names the crate `etcd_warden::`, not `crate::`.
    for (f, text) in &files {
        if !operator_side(f) {
            assert!(
                !text.contains("etcd_warden::operator"),
                "{f} names etcd_warden::operator"
            );
        }
    }
    // The check sees references at all: the operator's own files refer to each other.
    assert!(g["operator/quorum/execute.rs"].contains("operator/quorum/plan.rs"));
}

#[test]
fn no_two_files_import_each_other_even_around_a_circle() {
    let (_, files) = src();
    let g = graph(&files);
    // A module's own `mod.rs` is where its children are declared and re-exported: a child
    // naming its parent for a shared type is the tree, not a circle. Only edges between files
    // that are not parent and child count.
    let parent_of = |f: &str| -> Option<String> {
        let m = module_of(f);
        let p = &m[..m.len().checked_sub(1)?];
        files.keys().find(|k| module_of(k) == p).cloned()
    };
    let edges: BTreeMap<&String, Vec<&String>> = g
        .iter()
        .map(|(f, refs)| {
            let keep = refs
                .iter()
                .filter(|r| {
                    parent_of(f).as_deref() != Some(r.as_str())
                        && parent_of(r).as_deref() != Some(f.as_str())
                })
                .collect();
            (f, keep)
        })
        .collect();
    // Depth-first search for a back edge.
    fn visit<'a>(
        f: &'a String,
        edges: &BTreeMap<&'a String, Vec<&'a String>>,
        stack: &mut Vec<&'a String>,
        done: &mut BTreeSet<&'a String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|s| *s == f) {
            let mut circle: Vec<String> = stack[i..].iter().map(|s| s.to_string()).collect();
            circle.push(f.clone());
            return Some(circle);
        }
        if done.contains(f) {
            return None;
        }
        stack.push(f);
        for next in edges.get(f).into_iter().flatten() {
            if let Some(c) = visit(next, edges, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(f);
        None
    }
    let mut done = BTreeSet::new();
    for f in edges.keys() {
        let mut stack = Vec::new();
        if let Some(circle) = visit(f, &edges, &mut stack, &mut done) {
            panic!("import circle: {}", circle.join(" -> "));
        }
    }
}

#[test]
fn the_reference_finder_resolves_crate_and_super_paths() {
    let mut files = BTreeMap::new();
    files.insert("lib.rs".to_string(), String::new());
    files.insert(
        "a/mod.rs".to_string(),
        "pub mod b; use crate::c::D;".to_string(),
    );
    files.insert(
        "a/b.rs".to_string(),
        "use super::super::c::{D, E}; fn f() { crate::a::x(); my_crate::c::y(); }".to_string(),
    );
    files.insert("c.rs".to_string(), "use crate::a::b::F;".to_string());
    let g = graph(&files);
    assert_eq!(
        g["a/b.rs"],
        BTreeSet::from(["c.rs".to_string(), "a/mod.rs".to_string()])
    );
    assert_eq!(g["a/mod.rs"], BTreeSet::from(["c.rs".to_string()]));
    assert_eq!(g["c.rs"], BTreeSet::from(["a/b.rs".to_string()]));
}
