//! Listing a cloud store (S3, GCS, Azure) that holds a key which is no object key.
//!
//! object_store parses every key of a listed page into a `Path` and fails the whole page, and
//! with it the listing, at the first that does not parse: a key holding a newline or another
//! control character, an empty segment (`a//b`) or a `.` or `..` segment. One such object, put
//! there by another tool or by someone hostile, stopped `ls`, restore, `initialize`, `verify`
//! and retention. When a listing fails so, it is taken again page by page here: a page that
//! fails is asked for again in halves until the failing key stands alone, and that key, named
//! by the error, becomes an [`Entry::Unnamed`]; the listing resumes after it.
//!
//! A carriage return in a key is read as a newline (XML's line ends), so such a key is reported
//! under that name, and the keys that begin as it does up to there are reported once.
//!
//! A key ending in `/` is no error to object_store: it lists without the slash (its `Path`
//! drops it), so it shows under a name it does not have, and reading it by that name finds
//! nothing.

use std::sync::Arc;

use object_store::list::{PaginatedListOptions, PaginatedListStore};

use super::local::Entry;

/// Keys a full page asks for: S3's and GCS's largest page.
const PAGE: usize = 1000;

/// What lists a cloud store page by page.
#[derive(Clone)]
pub struct Pager {
    /// Builds the paginated client (again at each listing, so a rotated credential file is
    /// read as the store itself reads it).
    build: Arc<dyn Fn() -> object_store::Result<Arc<dyn PaginatedListStore>> + Send + Sync>,
    /// Whether the store's list offset includes the key it names (Azure's `startFrom`), not
    /// only the keys after it (S3's and GCS's `start-after`).
    inclusive_offset: bool,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager")
            .field("inclusive_offset", &self.inclusive_offset)
            .finish_non_exhaustive()
    }
}

impl Pager {
    /// A pager whose client `build` makes; `inclusive_offset` as Azure's list offset is.
    pub fn new(
        build: impl Fn() -> object_store::Result<Arc<dyn PaginatedListStore>> + Send + Sync + 'static,
        inclusive_offset: bool,
    ) -> Pager {
        Pager {
            build: Arc::new(build),
            inclusive_offset,
        }
    }

    /// Every object under `dir` (a key prefix ending in `/`), a key that is no object key as
    /// an [`Entry::Unnamed`] (its size unknown: 0), in key order.
    pub async fn list(&self, dir: &str) -> object_store::Result<Vec<Entry>> {
        let client = (self.build)()?;
        list(client.as_ref(), dir, self.inclusive_offset).await
    }
}

/// Where the next page starts.
enum Resume {
    Start,
    Token(String),
    After(String),
}

/// [`Pager::list`] with `client`.
pub async fn list(
    client: &dyn PaginatedListStore,
    dir: &str,
    inclusive_offset: bool,
) -> object_store::Result<Vec<Entry>> {
    let mut out = Vec::new();
    let mut from = Resume::Start;
    let mut size = PAGE;
    // The last key reported, and whether the keys beginning as it does were skipped.
    let mut skipped: Option<(String, bool)> = None;
    loop {
        let mut opts = PaginatedListOptions {
            max_keys: Some(size),
            ..Default::default()
        };
        match &from {
            Resume::Start => {}
            Resume::Token(token) => opts.page_token = Some(token.clone()),
            Resume::After(key) if inclusive_offset => opts.offset = Some(format!("{key}\u{0}")),
            Resume::After(key) => opts.offset = Some(key.clone()),
        }
        match client.list_paginated(Some(dir), opts).await {
            Ok(page) => {
                for meta in page.result.objects {
                    out.push(Entry::Object {
                        key: meta.location.to_string(),
                        size: meta.size,
                    });
                }
                match page.page_token {
                    Some(token) => from = Resume::Token(token),
                    None => return Ok(out),
                }
                size = (size * 2).min(PAGE);
            }
            Err(object_store::Error::InvalidPath { source }) => {
                let Some(bad) = raw_key(&source) else {
                    return Err(object_store::Error::InvalidPath { source });
                };
                if size > 1 {
                    size /= 2;
                    continue;
                }
                if let Some((last, ranged)) = &skipped
                    && *last == bad
                {
                    // XML reads a carriage return (or "\r\n") as a newline, so the key named
                    // is not the key stored, and starting after it finds the stored one again:
                    // start after every key that begins as it does up to that character (each
                    // holds a control character there: none is an object key).
                    if let (false, Some(at)) = (*ranged, bad.find('\n')) {
                        from = Resume::After(format!("{}\r\u{10ffff}", &bad[..at]));
                        skipped = Some((bad, true));
                        size = PAGE;
                        continue;
                    }
                    // A store that does not move past the key it was asked to start after
                    // would loop here for ever: fail, naming it.
                    return Err(object_store::Error::Generic {
                        store: "list",
                        source: format!(
                            "the listing does not move past the key {}, which is no object key",
                            escaped(&bad)
                        )
                        .into(),
                    });
                }
                out.push(Entry::Unnamed {
                    key: escaped(&bad),
                    size: 0,
                    reason: "the name holds a control character (such as a newline) or an empty, \
                             \".\" or \"..\" segment, so it is no object key"
                        .to_string(),
                });
                skipped = Some((bad.clone(), false));
                from = Resume::After(bad);
                size = PAGE;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The key a listed object's unparseable path error names.
fn raw_key(e: &object_store::path::Error) -> Option<String> {
    match e {
        object_store::path::Error::BadSegment { path, .. }
        | object_store::path::Error::EmptySegment { path } => Some(path.clone()),
        _ => None,
    }
}

/// `key` with everything but printable ASCII escaped, as [`super::local`] escapes file names.
fn escaped(key: &str) -> String {
    key.as_bytes().escape_ascii().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use object_store::list::PaginatedListResult;
    use object_store::path::Path;
    use object_store::{ListResult, ObjectMeta};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A bucket listed as object_store lists S3, GCS and Azure: a page whose keys do not all
    /// parse fails whole, naming the first that does not.
    struct Bucket {
        keys: Vec<String>,
        inclusive_offset: bool,
        /// Whether an offset is ignored (a store that does not move on).
        stuck: bool,
        requests: AtomicUsize,
    }

    #[async_trait]
    impl PaginatedListStore for Bucket {
        async fn list_paginated(
            &self,
            prefix: Option<&str>,
            opts: PaginatedListOptions,
        ) -> object_store::Result<PaginatedListResult> {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let after = opts.page_token.clone();
            let from = if self.stuck {
                None
            } else {
                opts.offset.clone()
            };
            let mut keys: Vec<&String> = self
                .keys
                .iter()
                .filter(|k| k.starts_with(prefix.unwrap_or("")))
                .filter(|k| after.as_ref().is_none_or(|a| k.as_str() > a.as_str()))
                .filter(|k| match &from {
                    None => true,
                    Some(o) if self.inclusive_offset => k.as_str() >= o.as_str(),
                    Some(o) => k.as_str() > o.as_str(),
                })
                .collect();
            keys.sort();
            let more = keys.len() > opts.max_keys.unwrap_or(PAGE);
            keys.truncate(opts.max_keys.unwrap_or(PAGE));
            let objects = keys
                .iter()
                .map(|k| {
                    // As XML reads line ends.
                    let shown = k.replace("\r\n", "\n").replace('\r', "\n");
                    Ok(ObjectMeta {
                        location: Path::parse(shown)?,
                        last_modified: chrono::Utc::now(),
                        size: 7,
                        e_tag: None,
                        version: None,
                    })
                })
                .collect::<object_store::Result<Vec<_>>>()?;
            Ok(PaginatedListResult {
                result: ListResult {
                    common_prefixes: vec![],
                    objects,
                    extensions: Default::default(),
                },
                page_token: more.then(|| keys.last().map(|k| k.to_string())).flatten(),
            })
        }
    }

    fn bucket(bad: &[&str], inclusive_offset: bool, stuck: bool) -> Bucket {
        let mut keys: Vec<String> = (0..2500).map(|i| format!("p/v2/Full-{i:08}")).collect();
        keys.extend(bad.iter().map(|k| k.to_string()));
        keys.push("p/other".into());
        Bucket {
            keys,
            inclusive_offset,
            stuck,
            requests: AtomicUsize::new(0),
        }
    }

    /// Every variant of a key that is no object key (a newline, a carriage return, another
    /// control character, `a//b`, `..`, `.`), among 2,500 good ones and in pages of 1,000: each
    /// good key listed once, each bad one an entry of its own, in a few dozen requests.
    #[tokio::test]
    async fn keys_that_are_no_object_keys_are_entries_and_the_listing_goes_on() {
        let bad = [
            "p/v2/Full-00000010\nFull-forged",
            "p/v2/Full-00000999\r",
            "p/v2/Full-00001999\r\nx",
            "p/v2/Full-00001000/\u{1}",
            "p/v2/Full-00001500//x",
            "p/v2/..",
            "p/v2/./y",
            "p/v2/zz\n",
        ];
        for inclusive in [false, true] {
            let b = bucket(&bad, inclusive, false);
            let got = list(&b, "p/v2/", inclusive).await.unwrap();
            let objects: Vec<&str> = got
                .iter()
                .filter_map(|e| match e {
                    Entry::Object { key, .. } => Some(key.as_str()),
                    Entry::Unnamed { .. } => None,
                })
                .collect();
            let want: Vec<String> = (0..2500).map(|i| format!("p/v2/Full-{i:08}")).collect();
            assert_eq!(objects, want);
            let mut unnamed: Vec<&str> = got
                .iter()
                .filter_map(|e| match e {
                    Entry::Unnamed { key, .. } => Some(key.as_str()),
                    Entry::Object { .. } => None,
                })
                .collect();
            unnamed.sort();
            let mut want: Vec<String> = bad
                .iter()
                .map(|k| escaped(&k.replace("\r\n", "\n").replace('\r', "\n")))
                .collect();
            want.sort();
            assert_eq!(unnamed, want);
            assert!(
                unnamed
                    .iter()
                    .all(|k| !k.contains('\n') && !k.contains('\r'))
            );
            let requests = b.requests.load(Ordering::Relaxed);
            assert!(requests < 200, "{requests} requests");
        }
    }

    /// A store that does not move past a key it cannot list is an error naming the key, not
    /// a listing that never ends.
    #[tokio::test]
    async fn a_store_that_does_not_move_on_fails_naming_the_key() {
        let b = bucket(&["p/v2/a\nb"], false, true);
        let e = list(&b, "p/v2/", false).await.unwrap_err().to_string();
        assert!(e.contains("p/v2/a\\nb"), "{e}");
    }
}
