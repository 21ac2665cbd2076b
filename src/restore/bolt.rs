//! etcd's backend file, a bbolt database, read and written directly.
//!
//! Only what a restore needs: [`Reader`] lists the top-level buckets of a snapshot and walks each
//! one's keys in order; [`Patcher`] changes an existing file the way a bbolt write transaction
//! does: the pages it changes are written anew after the file's last page (copy on write), the
//! pages they replace become free, and a new meta page, written last, makes the change the
//! current state. A restore patches the fetched snapshot so that the database is written once,
//! not fetched and then rewritten. The tests' databases are written by `NewFile` (tests only),
//! which builds a new, compact file bucket by bucket from keys given in order. Pages are bbolt's
//! format version 2 (etcd 3.4 to 3.6):
//!
//! - every page starts with a 16-byte header: id `u64`, flags `u16` (branch 0x01, leaf 0x02,
//!   meta 0x04, freelist 0x10), element count `u16`, overflow `u32` (pages that follow this one
//!   and belong to it); all integers little-endian;
//! - a leaf element is flags `u32` (0x01: the value is a bucket), `pos` `u32` (from the element to
//!   its key), key size `u32`, value size `u32`; the value follows the key;
//! - a branch element is `pos` `u32`, key size `u32`, child page id `u64`; its key is the child's
//!   first key;
//! - a bucket's value is its root page id `u64` and sequence `u64`; root 0 means the bucket's one
//!   leaf page follows inline;
//! - pages 0 and 1 are meta pages (magic, version, page size, flags, root bucket, freelist page,
//!   page count, transaction id, FNV-1a 64 checksum of the fields before it); the valid one with
//!   the higher transaction id is current.
//!
//! A patched file keeps the freelist's form: etcd stores none (the meta page's freelist is
//! [`NO_FREELIST`] and bbolt finds the free pages by walking the trees on open); a stored one
//! gets the replaced pages added. [`Reader::check`] proves either form consistent, as `bbolt
//! check` does. Anything this reader does not expect (a nested bucket, a key outside a bucket at
//! the top level, a page of the wrong kind) is an [`BoltError::Unsupported`], never a guess.
//!
//! A crafted file costs no more than a few reads of it: every walk marks each page's whole range
//! (the page and the overflow it claims) seen before it reads the overflow, so it reads a page at
//! most once, and a [`Reader`] reads at most [`READ_PASSES`] times the file's pages (and
//! [`READ_SLACK`]) over its life. [`Incoming`] checks a fetched snapshot's bytes against its meta
//! pages before they are written.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio_util::sync::CancellationToken;

const MAGIC: u32 = 0xED0C_DAED;
const VERSION: u32 = 2;
const HEADER: usize = 16;
const ELEMENT: usize = 16;
const BRANCH_PAGE: u16 = 0x01;
const LEAF_PAGE: u16 = 0x02;
const META_PAGE: u16 = 0x04;
const FREELIST_PAGE: u16 = 0x10;
/// Leaf element flag: the value is a bucket.
const BUCKET_VALUE: u32 = 0x01;
/// Bytes of the meta fields the checksum covers.
const META_CHECKED: usize = 56;
/// The page sizes a database may have (bbolt's are the OS page size, 4 KiB to 64 KiB).
const MIN_PAGE_SIZE: usize = 512;
const MAX_PAGE_SIZE: usize = 1 << 20;
/// A meta page's bytes that are read: its page header and its fields with their checksum.
const META_LEN: usize = HEADER + META_CHECKED + 8;
/// The bytes at a file's start that decide its meta pages: page 1 at the largest page size.
pub const HEAD_LEN: usize = MAX_PAGE_SIZE + META_LEN;
/// Deeper trees than this are not B+trees of a real database (a cycle, say).
const MAX_DEPTH: usize = 32;
/// The meta page's freelist when none is stored (bbolt's `NoFreelistSync`, etcd's setting).
pub const NO_FREELIST: u64 = u64::MAX;
/// How many times its pages over a [`Reader`] may read a file (every walk reads a page at most
/// once; a restore walks a few trees, a few times): beyond, its trees share pages over and over.
pub const READ_PASSES: u64 = 16;
/// Page reads a [`Reader`] may make beyond [`READ_PASSES`] times the file's pages (a small file's
/// few walks of its root).
pub const READ_SLACK: u64 = 256;
/// A freelist page's element count at or above which the count is the page's first element.
const FREELIST_COUNT_IN_BODY: u16 = 0xFFFF;

/// What went wrong reading or writing a bbolt file.
#[derive(Debug, thiserror::Error)]
pub enum BoltError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The file is damaged or not a bbolt file.
    #[error("not a valid bbolt file: {0}")]
    Corrupt(String),
    /// A valid file with a shape this module does not handle.
    #[error("unsupported bbolt layout: {0}")]
    Unsupported(String),
    /// The reading was stopped (the restore that started it was dropped: a signal).
    #[error("stopped before the database was read")]
    Cancelled,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// FNV-1a, 64 bits: bbolt's meta checksum.
fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The fields of a meta page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Meta {
    page_size: u32,
    flags: u32,
    root: u64,
    sequence: u64,
    freelist: u64,
    pages: u64,
    txid: u64,
}

impl Meta {
    /// Parses the meta page `page` (header included); `None` when it is not a valid meta page.
    fn parse(page: &[u8]) -> Option<Meta> {
        if page.len() < META_LEN || u16_at(page, 8) & META_PAGE == 0 {
            return None;
        }
        let m = &page[HEADER..];
        if u32_at(m, 0) != MAGIC || u32_at(m, 4) != VERSION {
            return None;
        }
        if fnv1a64(&m[..META_CHECKED]) != u64_at(m, META_CHECKED) {
            return None;
        }
        Some(Meta {
            page_size: u32_at(m, 8),
            flags: u32_at(m, 12),
            root: u64_at(m, 16),
            sequence: u64_at(m, 24),
            freelist: u64_at(m, 32),
            pages: u64_at(m, 40),
            txid: u64_at(m, 48),
        })
    }

    /// Meta page `id` with these fields, `page_size` bytes.
    fn page(&self, id: u64) -> Vec<u8> {
        let mut page = vec![0u8; self.page_size as usize];
        page[..8].copy_from_slice(&id.to_le_bytes());
        page[8..10].copy_from_slice(&META_PAGE.to_le_bytes());
        let m = &mut page[HEADER..];
        m[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        m[4..8].copy_from_slice(&VERSION.to_le_bytes());
        m[8..12].copy_from_slice(&self.page_size.to_le_bytes());
        m[12..16].copy_from_slice(&self.flags.to_le_bytes());
        m[16..24].copy_from_slice(&self.root.to_le_bytes());
        m[24..32].copy_from_slice(&self.sequence.to_le_bytes());
        m[32..40].copy_from_slice(&self.freelist.to_le_bytes());
        m[40..48].copy_from_slice(&self.pages.to_le_bytes());
        m[48..56].copy_from_slice(&self.txid.to_le_bytes());
        let sum = fnv1a64(&m[..META_CHECKED]);
        m[56..64].copy_from_slice(&sum.to_le_bytes());
        page
    }
}

/// Where a bucket's tree starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Root {
    /// A page of the file.
    Page(u64),
    /// One leaf page stored in the parent's value (header included).
    Inline(Vec<u8>),
}

/// A top-level bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub name: Vec<u8>,
    pub sequence: u64,
    pub root: Root,
}

impl Bucket {
    /// Its value in the root bucket, as bbolt stores it: root page and sequence, then the page
    /// of an inline bucket.
    pub fn value(&self) -> Vec<u8> {
        let (root, inline): (u64, &[u8]) = match &self.root {
            Root::Page(id) => (*id, &[]),
            Root::Inline(page) => (0, page),
        };
        let mut value = bucket_value(root, self.sequence).to_vec();
        value.extend_from_slice(inline);
        value
    }
}

#[cfg(test)]
impl Bucket {
    /// A bucket of sequence 0 whose tree starts at page `root` (one a [`NewFile`] wrote).
    pub fn paged(name: &[u8], root: u64) -> Bucket {
        Bucket {
            name: name.to_vec(),
            sequence: 0,
            root: Root::Page(root),
        }
    }
}

/// The value of a bucket whose tree starts at page `root`.
fn bucket_value(root: u64, sequence: u64) -> [u8; 16] {
    let mut value = [0u8; 16];
    value[..8].copy_from_slice(&root.to_le_bytes());
    value[8..].copy_from_slice(&sequence.to_le_bytes());
    value
}

/// Whether `size` is a page size a database may have.
fn valid_page_size(size: usize) -> bool {
    (MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&size) && size.is_power_of_two()
}

/// The current meta page of a file that starts with `head` (its first [`HEAD_LEN`] bytes, or all
/// of it): the valid one of pages 0 and 1 with the higher transaction id, as bbolt chooses. Page
/// 0 gives the page size; when it is torn, page 1 is looked for at every page size, as bbolt
/// does. One torn meta page is legal (a crash while it was written); both torn is no database.
fn current_meta(head: &[u8]) -> Result<Meta, BoltError> {
    let meta0 = Meta::parse(head).filter(|m| valid_page_size(m.page_size as usize));
    let at = |size: usize| head.get(size..).and_then(Meta::parse);
    let meta1 = match meta0 {
        Some(m) => at(m.page_size as usize),
        None => (MIN_PAGE_SIZE.trailing_zeros()..=MAX_PAGE_SIZE.trailing_zeros())
            .map(|shift| 1usize << shift)
            .find_map(|size| at(size).filter(|m| m.page_size as usize == size)),
    };
    match (meta0, meta1) {
        (Some(a), Some(b)) if a.page_size != b.page_size => Err(BoltError::Corrupt(
            "the meta pages disagree on the page size".into(),
        )),
        (Some(a), Some(b)) => Ok(if b.txid > a.txid { b } else { a }),
        (Some(m), None) | (None, Some(m)) => Ok(m),
        (None, None) => Err(BoltError::Corrupt(
            "neither meta page (page 0, or page 1 at any page size) holds bbolt's magic, \
             version 2 and a valid checksum: not a bbolt database"
                .into(),
        )),
    }
}

/// The pages one walk has reached, a bit per page: every page a page claims (itself and its
/// overflow) is marked before its overflow is read, so a walk reads each page at most once and
/// a page claimed twice (a cycle, or a page inside another's overflow) is refused.
struct Seen(Vec<u64>);

impl Seen {
    fn new(pages: u64) -> Seen {
        Seen(vec![0u64; (pages as usize).div_ceil(64)])
    }

    /// Marks pages `first..=last` (below the high-water mark: the caller checked).
    fn mark(&mut self, first: u64, last: u64) -> Result<(), BoltError> {
        for p in first..=last {
            let (word, bit) = ((p / 64) as usize, 1u64 << (p % 64));
            if self.0[word] & bit != 0 {
                return Err(BoltError::Corrupt(format!("page {p} is reached twice")));
            }
            self.0[word] |= bit;
        }
        Ok(())
    }
}

/// Checks a full snapshot's bytes as they arrive, before they are written: the first ones must
/// be bbolt's meta pages (one may be torn, not both), and the stream may hold exactly the pages
/// the current one declares (bbolt's `WriteTo`, what etcd's snapshot streams) and then etcd's
/// hash. The head is held in memory (at most [`HEAD_LEN`] bytes) until the meta pages decide, so
/// what is not a database writes nothing, and no byte past the declared size is passed on.
pub struct Incoming {
    head: Vec<u8>,
    /// The bytes the stream must hold, once the meta pages are read.
    expected: Option<Expected>,
    /// The bytes received.
    received: u64,
    trailer: u64,
}

/// What the current meta page declares.
#[derive(Debug, Clone, Copy)]
struct Expected {
    pages: u64,
    page_size: u32,
    /// Pages × page size, and the trailer.
    total: u64,
}

impl Incoming {
    /// Checks a stream of a database and then `trailer` bytes (etcd's 32-byte hash).
    pub fn new(trailer: usize) -> Incoming {
        Incoming {
            head: Vec::new(),
            expected: None,
            received: 0,
            trailer: trailer as u64,
        }
    }

    /// Takes the next chunk: `None` while the head is held, then the bytes to write (the held
    /// head with this chunk, or this chunk).
    pub fn push<'c>(
        &mut self,
        chunk: &'c [u8],
    ) -> Result<Option<std::borrow::Cow<'c, [u8]>>, BoltError> {
        self.received += chunk.len() as u64;
        if let Some(expected) = self.expected {
            self.within(expected)?;
            return Ok(Some(std::borrow::Cow::Borrowed(chunk)));
        }
        self.head.extend_from_slice(chunk);
        // Page 0 valid, page 1 in the head: decided; page 0 torn: page 1 may be at any size.
        let decided = match Meta::parse(&self.head) {
            Some(m) if valid_page_size(m.page_size as usize) => {
                self.head.len() >= m.page_size as usize + META_LEN
            }
            _ => self.head.len() >= HEAD_LEN,
        };
        if !decided {
            return Ok(None);
        }
        self.decide()?;
        Ok(Some(std::borrow::Cow::Owned(std::mem::take(
            &mut self.head,
        ))))
    }

    /// The end of the stream: what is still held, to write, once the stream is as long as its
    /// meta page says.
    pub fn finish(mut self) -> Result<Vec<u8>, BoltError> {
        let expected = match self.expected {
            Some(e) => e,
            None => self.decide()?,
        };
        if self.received < expected.total {
            return Err(BoltError::Corrupt(format!(
                "{} bytes, shorter than the {} pages of {} bytes its meta page declares and the \
                 {}-byte hash ({} bytes)",
                self.received, expected.pages, expected.page_size, self.trailer, expected.total
            )));
        }
        Ok(self.head)
    }

    fn decide(&mut self) -> Result<Expected, BoltError> {
        let meta = current_meta(&self.head)?;
        let total = meta
            .pages
            .checked_mul(u64::from(meta.page_size))
            .and_then(|db| db.checked_add(self.trailer))
            .ok_or_else(|| {
                BoltError::Corrupt(format!("a meta page declaring {} pages", meta.pages))
            })?;
        let expected = Expected {
            pages: meta.pages,
            page_size: meta.page_size,
            total,
        };
        self.expected = Some(expected);
        self.within(expected)?;
        Ok(expected)
    }

    fn within(&self, expected: Expected) -> Result<(), BoltError> {
        if self.received > expected.total {
            return Err(BoltError::Corrupt(format!(
                "{} bytes and more, beyond the {} pages of {} bytes its meta page declares and \
                 the {}-byte hash ({} bytes)",
                self.received, expected.pages, expected.page_size, self.trailer, expected.total
            )));
        }
        Ok(())
    }
}

/// What [`Reader::check`] found in a consistent file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    /// Pages below the high-water mark, meta pages included.
    pub pages: u64,
    /// Pages some tree (or the freelist page) uses.
    pub used: u64,
    /// Pages free: listed in the stored freelist, or unreached when none is stored.
    pub free: u64,
}

/// What a stored freelist holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Freelist {
    /// The pages it lists free.
    pub free: Vec<u64>,
    /// The freelist's own pages (its page and overflow).
    pub own: Vec<u64>,
}

/// A page of a tree's rightmost path: its id (`None` for an inline bucket's) and its bytes.
type SpinePage = (Option<u64>, Vec<u8>);

/// A leaf element: (flags, key, value).
pub type Element<'a> = (u32, &'a [u8], &'a [u8]);

/// What [`Reader::visit`] calls for every element.
pub type Visitor<'f> = dyn FnMut(u32, &[u8], &[u8]) -> Result<(), BoltError> + 'f;

/// The offset of element `i` of `page`, checked to lie within it.
fn element_at(page: &[u8], i: usize, kind: &str) -> Result<usize, BoltError> {
    let e = HEADER + i * ELEMENT;
    if e + ELEMENT > page.len() {
        return Err(BoltError::Corrupt(format!(
            "{kind} element {i} beyond its page"
        )));
    }
    Ok(e)
}

/// `len` bytes at `at` in `page`, checked to lie within it.
fn span<'p>(
    page: &'p [u8],
    at: usize,
    len: usize,
    i: usize,
    kind: &str,
) -> Result<&'p [u8], BoltError> {
    page.get(at..at.saturating_add(len))
        .ok_or_else(|| BoltError::Corrupt(format!("{kind} element {i} points beyond its page")))
}

/// Elements of a leaf page.
fn leaf_elements(page: &[u8]) -> Result<Vec<Element<'_>>, BoltError> {
    (0..usize::from(u16_at(page, 10)))
        .map(|i| {
            let e = element_at(page, i, "leaf")?;
            let (flags, pos, ksize, vsize) = (
                u32_at(page, e),
                u32_at(page, e + 4) as usize,
                u32_at(page, e + 8) as usize,
                u32_at(page, e + 12) as usize,
            );
            let key = span(page, e + pos, ksize, i, "leaf")?;
            let value = span(page, e + pos + ksize, vsize, i, "leaf")?;
            Ok((flags, key, value))
        })
        .collect()
}

/// Elements of a branch page: (first key of the child, child page).
fn branch_elements(page: &[u8]) -> Result<Vec<(&[u8], u64)>, BoltError> {
    (0..usize::from(u16_at(page, 10)))
        .map(|i| {
            let e = element_at(page, i, "branch")?;
            let (pos, ksize) = (u32_at(page, e) as usize, u32_at(page, e + 4) as usize);
            Ok((
                span(page, e + pos, ksize, i, "branch")?,
                u64_at(page, e + 8),
            ))
        })
        .collect()
}

/// Reads a bbolt file.
pub struct Reader {
    file: File,
    /// Bytes of the file that belong to the database (a snapshot has etcd's hash after them).
    len: u64,
    meta: Meta,
    /// Pages read so far, overflow pages included.
    reads: AtomicU64,
    /// Set when whoever reads through this stops waiting for it.
    cancel: Option<CancellationToken>,
}

impl Reader {
    /// Opens the database in the first `len` bytes of `path`.
    pub fn open(path: &Path, len: u64) -> Result<Reader, BoltError> {
        let file = File::open(path)?;
        let mut head = vec![0u8; (HEAD_LEN as u64).min(len) as usize];
        file.read_exact_at(&mut head, 0)?;
        let meta = current_meta(&head)?;
        let page_size = u64::from(meta.page_size);
        if meta.pages.saturating_mul(page_size) > len {
            return Err(BoltError::Corrupt(format!(
                "{} pages of {page_size} bytes do not fit in {len} bytes",
                meta.pages
            )));
        }
        Ok(Reader {
            file,
            len,
            meta,
            reads: AtomicU64::new(0),
            cancel: None,
        })
    }

    /// This reader, stopping with [`BoltError::Cancelled`] at the next page once `cancel` is.
    pub fn cancel_on(mut self, cancel: CancellationToken) -> Reader {
        self.cancel = Some(cancel);
        self
    }

    /// The database's pages (its high-water mark, meta pages included).
    pub fn pages(&self) -> u64 {
        self.meta.pages
    }

    /// Pages read so far (overflow pages included).
    pub fn pages_read(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// The page size.
    pub fn page_size(&self) -> usize {
        self.meta.page_size as usize
    }

    /// The transaction that wrote the current meta page.
    pub fn txid(&self) -> u64 {
        self.meta.txid
    }

    /// Page `id` with its overflow pages, once: its whole range is marked in `seen` (the walk's
    /// pages) before the overflow is read.
    fn page(&self, id: u64, seen: &mut Seen) -> Result<Vec<u8>, BoltError> {
        let ps = self.meta.page_size as u64;
        if id < 2 || id >= self.meta.pages {
            return Err(BoltError::Corrupt(format!(
                "page {id} outside the database's {} pages",
                self.meta.pages
            )));
        }
        self.charge(1)?;
        let mut page = vec![0u8; ps as usize];
        self.file.read_exact_at(&mut page, id * ps)?;
        let overflow = u64::from(u32_at(&page, 12));
        if id + overflow >= self.meta.pages || (id + overflow + 1) * ps > self.len {
            return Err(BoltError::Corrupt(format!(
                "page {id} overflows past the end"
            )));
        }
        seen.mark(id, id + overflow)?;
        if overflow > 0 {
            self.charge(overflow)?;
            page.resize(((overflow + 1) * ps) as usize, 0);
            self.file
                .read_exact_at(&mut page[ps as usize..], (id + 1) * ps)?;
        }
        Ok(page)
    }

    /// A walk's record of the pages it reached: none yet.
    fn seen(&self) -> Seen {
        Seen::new(self.meta.pages)
    }

    /// Counts `pages` read: a cancelled reader stops here, and one that has read
    /// [`READ_PASSES`] times its file's pages (and [`READ_SLACK`]) refuses to read more.
    fn charge(&self, pages: u64) -> Result<(), BoltError> {
        if self.cancel.as_ref().is_some_and(|c| c.is_cancelled()) {
            return Err(BoltError::Cancelled);
        }
        let budget = READ_PASSES
            .saturating_mul(self.meta.pages)
            .saturating_add(READ_SLACK);
        let read = self.reads.load(Ordering::Relaxed) + pages;
        if read > budget {
            return Err(BoltError::Corrupt(format!(
                "more than {budget} page reads of a {}-page database: its trees reach the same \
                 pages over and over",
                self.meta.pages
            )));
        }
        self.reads.store(read, Ordering::Relaxed);
        Ok(())
    }

    /// The top-level buckets, in key order.
    pub fn buckets(&self) -> Result<Vec<Bucket>, BoltError> {
        let mut out = Vec::new();
        self.visit(&Root::Page(self.meta.root), &mut |flags, name, value| {
            if flags & BUCKET_VALUE == 0 {
                return Err(BoltError::Unsupported(format!(
                    "a key outside any bucket ({:?})",
                    String::from_utf8_lossy(name)
                )));
            }
            out.push(Bucket {
                name: name.to_vec(),
                sequence: bucket_sequence(value)?,
                root: bucket_root(value)?,
            });
            Ok(())
        })?;
        Ok(out)
    }

    /// Calls `f` with (flags, key, value) for every element of the tree at `root`, in key order.
    pub fn visit(&self, root: &Root, f: &mut Visitor<'_>) -> Result<(), BoltError> {
        match root {
            Root::Inline(page) => {
                if u16_at(page, 8) & LEAF_PAGE == 0 {
                    return Err(BoltError::Corrupt(
                        "an inline bucket that is no leaf".into(),
                    ));
                }
                for (flags, k, v) in leaf_elements(page)? {
                    f(flags, k, v)?;
                }
                Ok(())
            }
            Root::Page(id) => self.visit_page(*id, 0, &mut self.seen(), f),
        }
    }

    /// Visits the tree at page `id`; `seen` has a bit per page of the file, so a damaged file
    /// whose pages point back at each other, or into each other's overflow, costs one read a
    /// page, not a loop or a read of the file per leaf.
    fn visit_page(
        &self,
        id: u64,
        depth: usize,
        seen: &mut Seen,
        f: &mut Visitor<'_>,
    ) -> Result<(), BoltError> {
        if depth > MAX_DEPTH {
            return Err(BoltError::Corrupt(format!("tree deeper than {MAX_DEPTH}")));
        }
        let page = self.page(id, seen)?;
        let flags = u16_at(&page, 8);
        if flags & LEAF_PAGE != 0 {
            for (flags, k, v) in leaf_elements(&page)? {
                f(flags, k, v)?;
            }
            Ok(())
        } else if flags & BRANCH_PAGE != 0 {
            for (_, child) in branch_elements(&page)? {
                self.visit_page(child, depth + 1, seen, f)?;
            }
            Ok(())
        } else {
            Err(BoltError::Corrupt(format!(
                "page {id} is neither branch nor leaf (flags {flags:#x})"
            )))
        }
    }

    /// The last key of the tree at `root`, if it has any: only the rightmost path is read.
    pub fn last_key(&self, root: &Root) -> Result<Option<Vec<u8>>, BoltError> {
        let mut seen = self.seen();
        let mut page = match root {
            Root::Inline(page) => page.clone(),
            Root::Page(id) => self.page(*id, &mut seen)?,
        };
        for _ in 0..=MAX_DEPTH {
            let flags = u16_at(&page, 8);
            if flags & LEAF_PAGE != 0 {
                return Ok(leaf_elements(&page)?.last().map(|(_, k, _)| k.to_vec()));
            }
            if flags & BRANCH_PAGE == 0 {
                return Err(BoltError::Corrupt(format!("page flags {flags:#x}")));
            }
            match branch_elements(&page)?.last() {
                Some(&(_, child)) => page = self.page(child, &mut seen)?,
                None => return Ok(None),
            }
        }
        Err(BoltError::Corrupt(format!("tree deeper than {MAX_DEPTH}")))
    }

    /// The value of `key` in the tree at `root` (a full scan: for small buckets).
    pub fn get(&self, root: &Root, key: &[u8]) -> Result<Option<Vec<u8>>, BoltError> {
        let mut found = None;
        self.visit(root, &mut |_, k, v| {
            if k == key {
                found = Some(v.to_vec());
            }
            Ok(())
        })?;
        Ok(found)
    }

    /// Every page of the tree at `root` (overflow pages included), each once: an inline bucket
    /// has none. A page reached twice is [`BoltError::Corrupt`].
    pub fn tree_pages(&self, root: &Root) -> Result<Vec<u64>, BoltError> {
        let mut out = Vec::new();
        if let Root::Page(id) = root {
            self.collect_pages(*id, 0, &mut self.seen(), &mut out, &mut |_, _, _| Ok(()))?;
        }
        Ok(out)
    }

    /// Adds page `id` and the pages under it to `out`; `nested` is called for every bucket
    /// element of a leaf (flags, key, value).
    fn collect_pages(
        &self,
        id: u64,
        depth: usize,
        seen: &mut Seen,
        out: &mut Vec<u64>,
        nested: &mut Visitor<'_>,
    ) -> Result<(), BoltError> {
        if depth > MAX_DEPTH {
            return Err(BoltError::Corrupt(format!("tree deeper than {MAX_DEPTH}")));
        }
        let page = self.page(id, seen)?;
        out.extend(id..=id + u64::from(u32_at(&page, 12)));
        let flags = u16_at(&page, 8);
        if flags & LEAF_PAGE != 0 {
            for (flags, k, v) in leaf_elements(&page)? {
                if flags & BUCKET_VALUE != 0 {
                    nested(flags, k, v)?;
                }
            }
            Ok(())
        } else if flags & BRANCH_PAGE != 0 {
            for (_, child) in branch_elements(&page)? {
                self.collect_pages(child, depth + 1, seen, out, nested)?;
            }
            Ok(())
        } else {
            Err(BoltError::Corrupt(format!(
                "page {id} is neither branch nor leaf (flags {flags:#x})"
            )))
        }
    }

    /// The pages the stored freelist lists, and the freelist's own pages; `None` when no
    /// freelist is stored ([`NO_FREELIST`]).
    pub fn freelist(&self) -> Result<Option<Freelist>, BoltError> {
        self.freelist_in(&mut self.seen())
    }

    /// [`Reader::freelist`], its pages marked in `seen` (the walk of [`Reader::check`]).
    fn freelist_in(&self, seen: &mut Seen) -> Result<Option<Freelist>, BoltError> {
        if self.meta.freelist == NO_FREELIST {
            return Ok(None);
        }
        let id = self.meta.freelist;
        let page = self.page(id, seen)?;
        if u16_at(&page, 8) & FREELIST_PAGE == 0 {
            return Err(BoltError::Corrupt(format!("page {id} is no freelist")));
        }
        let own = (id..=id + u64::from(u32_at(&page, 12))).collect();
        let (count, first) = match u16_at(&page, 10) {
            FREELIST_COUNT_IN_BODY => (
                usize::try_from(u64_at(&page, HEADER)).unwrap_or(usize::MAX),
                HEADER + 8,
            ),
            n => (usize::from(n), HEADER),
        };
        let free = span(&page, first, count.saturating_mul(8), 0, "freelist")?
            .chunks_exact(8)
            .map(|c| u64_at(c, 0))
            .collect();
        Ok(Some(Freelist { free, own }))
    }

    /// Checks the file as `bbolt check` does: every page below the high-water mark is used by
    /// exactly one tree (or is the freelist's), or is free, never both, and no tree reaches a
    /// page twice or past the end. Without a stored freelist, the pages no tree reaches are the
    /// free ones (what bbolt computes on open).
    pub fn check(&self) -> Result<Check, BoltError> {
        let pages = self.meta.pages;
        let mut seen = self.seen();
        let mut used = Vec::new();
        let mut roots = vec![self.meta.root];
        while let Some(root) = roots.pop() {
            let mut found = Vec::new();
            self.collect_pages(root, 0, &mut seen, &mut used, &mut |_, _, v| {
                if let Root::Page(id) = bucket_root(v)? {
                    found.push(id);
                }
                Ok(())
            })?;
            roots.extend(found);
        }
        // The freelist's own pages are marked as it is read: one the trees use is reached twice.
        let free = match self.freelist_in(&mut seen)? {
            None => pages - 2 - used.len() as u64,
            Some(Freelist { free, own }) => {
                used.extend(own);
                for &p in &free {
                    mark(&mut seen.0, p, pages, "a free page")?;
                }
                let listed = free.len() as u64;
                let accounted = 2 + used.len() as u64 + listed;
                if accounted != pages {
                    return Err(BoltError::Corrupt(format!(
                        "{} of {pages} pages are neither used nor free",
                        pages.saturating_sub(accounted)
                    )));
                }
                listed
            }
        };
        Ok(Check {
            pages,
            used: used.len() as u64,
            free,
        })
    }

    /// The rightmost path of the tree at `root`, root first: each page with its id (`None`
    /// for an inline bucket's page).
    fn right_spine(&self, root: &Root) -> Result<Vec<SpinePage>, BoltError> {
        let mut seen = self.seen();
        let mut path = vec![match root {
            Root::Inline(page) => (None, page.clone()),
            Root::Page(id) => (Some(*id), self.page(*id, &mut seen)?),
        }];
        for _ in 0..=MAX_DEPTH {
            let page = &path.last().expect("a page").1;
            let flags = u16_at(page, 8);
            if flags & LEAF_PAGE != 0 {
                return Ok(path);
            }
            if flags & BRANCH_PAGE == 0 {
                return Err(BoltError::Corrupt(format!("page flags {flags:#x}")));
            }
            let child = match branch_elements(page)?.last() {
                Some(&(_, child)) => child,
                None => return Err(BoltError::Corrupt("an empty branch page".into())),
            };
            path.push((Some(child), self.page(child, &mut seen)?));
        }
        Err(BoltError::Corrupt(format!("tree deeper than {MAX_DEPTH}")))
    }
}

/// Marks page `p` seen for [`Reader::check`]: it must be a data page, not seen before.
fn mark(seen: &mut [u64], p: u64, pages: u64, what: &str) -> Result<(), BoltError> {
    if p < 2 || p >= pages {
        return Err(BoltError::Corrupt(format!(
            "{what}, {p}, outside pages 2 to {}",
            pages - 1
        )));
    }
    let (word, bit) = ((p / 64) as usize, 1u64 << (p % 64));
    if seen[word] & bit != 0 {
        return Err(BoltError::Corrupt(format!(
            "{what}, {p}, is also used or listed twice"
        )));
    }
    seen[word] |= bit;
    Ok(())
}

fn bucket_sequence(value: &[u8]) -> Result<u64, BoltError> {
    if value.len() < 16 {
        return Err(BoltError::Corrupt(
            "a bucket value shorter than its header".into(),
        ));
    }
    Ok(u64_at(value, 8))
}

fn bucket_root(value: &[u8]) -> Result<Root, BoltError> {
    if value.len() < 16 {
        return Err(BoltError::Corrupt(
            "a bucket value shorter than its header".into(),
        ));
    }
    match u64_at(value, 0) {
        0 if value.len() >= 16 + HEADER => Ok(Root::Inline(value[16..].to_vec())),
        0 => Err(BoltError::Corrupt(
            "an inline bucket without its page".into(),
        )),
        id => Ok(Root::Page(id)),
    }
}

/// Pages appended to a file, one after another from page `next`: what [`Patcher`] and the
/// test-only `NewFile` share, and what a [`Tree`] writes into.
struct Pages {
    out: BufWriter<File>,
    page_size: usize,
    /// The next page id.
    next: u64,
}

impl Pages {
    /// Writes one page (and its overflow) from `body`, the bytes after the header. Returns its id.
    fn write(&mut self, flags: u16, count: u16, body: &[u8]) -> Result<u64, BoltError> {
        let len = HEADER + body.len();
        let pages = len.div_ceil(self.page_size).max(1);
        let id = self.next;
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&id.to_le_bytes());
        header[8..10].copy_from_slice(&flags.to_le_bytes());
        header[10..12].copy_from_slice(&count.to_le_bytes());
        header[12..16].copy_from_slice(&((pages - 1) as u32).to_le_bytes());
        self.out.write_all(&header)?;
        self.out.write_all(body)?;
        self.out
            .write_all(&vec![0u8; pages * self.page_size - len])?;
        self.next += pages as u64;
        Ok(id)
    }

    /// A builder for one bucket's tree; give it keys in ascending order.
    fn tree(&mut self) -> Tree<'_> {
        Tree {
            leaf: Packer::new(LEAF_PAGE),
            children: Vec::new(),
            last: None,
            prefixes: Vec::new(),
            pages: self,
        }
    }

    /// The root bucket: one element per top-level bucket (names ascending). Returns its page.
    fn root(&mut self, buckets: &[Bucket]) -> Result<u64, BoltError> {
        let mut root = self.tree();
        for bucket in buckets {
            root.push_element(BUCKET_VALUE, &bucket.name, &bucket.value())?;
        }
        root.finish()
    }
}

/// Changes the bbolt file a [`Reader`] reads the way one bbolt write transaction does (the
/// restore's path: the fetched snapshot patched in place): the pages it changes are written anew
/// after the file's last page (copy on write), the pages they replace become free, and
/// [`Patcher::commit`] writes the meta page of the next transaction last, which makes the change
/// the current state. Until then nothing the current meta page reaches is overwritten. It never
/// writes a new file's meta pages or freelist: the file keeps its freelist's form.
pub struct Patcher<'r> {
    reader: &'r Reader,
    pages: Pages,
    /// Pages of the file the new ones replace: free once the patch is committed.
    freed: Vec<u64>,
}

impl<'r> Patcher<'r> {
    /// Starts a patch of the database `reader` reads (at `path`): new pages go after its last
    /// one. Whatever followed the database in the file (a snapshot's hash) is overwritten.
    pub fn open(path: &Path, reader: &'r Reader) -> Result<Patcher<'r>, BoltError> {
        let mut file = std::fs::OpenOptions::new().write(true).open(path)?;
        let meta = reader.meta;
        file.seek(SeekFrom::Start(meta.pages * u64::from(meta.page_size)))?;
        Ok(Patcher {
            reader,
            pages: Pages {
                out: BufWriter::with_capacity(1 << 20, file),
                page_size: meta.page_size as usize,
                next: meta.pages,
            },
            freed: Vec::new(),
        })
    }

    /// Marks `pages` of the file free once the patch is committed.
    fn free(&mut self, pages: impl IntoIterator<Item = u64>) {
        self.freed.extend(pages);
    }

    /// A builder for a new tree in place of the one at `root`, whose pages are freed; give it
    /// keys in ascending order.
    pub fn replace(&mut self, root: &Root) -> Result<Tree<'_>, BoltError> {
        let old = self.reader.tree_pages(root)?;
        self.free(old);
        Ok(self.pages.tree())
    }

    /// A builder that adds keys after the last one of the tree at `root`: only the tree's
    /// rightmost path is rewritten (its last leaf and the branch pages above it), and those
    /// pages are freed. Keys must come after the tree's last key.
    pub fn extend(&mut self, root: &Root) -> Result<Tree<'_>, BoltError> {
        let spine = self.reader.right_spine(root)?;
        let mut leaf = Packer::new(LEAF_PAGE);
        let mut last = None;
        let mut prefixes = Vec::new();
        for (i, (id, page)) in spine.iter().enumerate() {
            if let Some(id) = id {
                self.free(*id..=*id + u64::from(u32_at(page, 12)));
            }
            if i + 1 == spine.len() {
                for (flags, k, v) in leaf_elements(page)? {
                    leaf.push(flags, k, v, 0);
                    last = Some(k.to_vec());
                }
            } else {
                let mut elements = branch_elements(page)?;
                elements.pop();
                prefixes.push(
                    elements
                        .into_iter()
                        .map(|(k, child)| (k.to_vec(), child))
                        .collect(),
                );
            }
        }
        // Bottom-up: the branch just above the leaf first.
        prefixes.reverse();
        Ok(Tree {
            leaf,
            children: Vec::new(),
            last,
            prefixes,
            pages: &mut self.pages,
        })
    }

    /// Commits the patch: writes the root bucket with `buckets` (names ascending: each the
    /// file's own, or one with the root a [`Tree`] of this patch returned), the freelist in the
    /// file's form (none stored stays none; a stored one gets the replaced pages added), then
    /// the meta page of the next transaction, and cuts the file after the last page. The file is
    /// not synced.
    pub fn commit(mut self, buckets: &[Bucket]) -> Result<(), BoltError> {
        let reader = self.reader;
        let meta = reader.meta;
        self.free(reader.tree_pages(&Root::Page(meta.root))?);
        let root = self.pages.root(buckets)?;
        let freelist = match reader.freelist()? {
            None => NO_FREELIST,
            Some(Freelist { mut free, own }) => {
                free.extend(own);
                free.append(&mut self.freed);
                free.sort_unstable();
                free.dedup();
                self.freelist_page(&free)?
            }
        };
        let Pages {
            out,
            page_size,
            next,
        } = self.pages;
        let mut file = out.into_inner().map_err(|e| e.into_error())?;
        let txid = meta.txid + 1;
        let meta = Meta {
            root,
            freelist,
            pages: next,
            txid,
            ..meta
        };
        // bbolt alternates: transaction `txid` writes meta page `txid % 2`; the other one
        // still describes the file as it was, whose pages this patch left alone.
        file.seek(SeekFrom::Start((txid % 2) * page_size as u64))?;
        file.write_all(&meta.page(txid % 2))?;
        file.set_len(next * page_size as u64)?;
        Ok(())
    }

    /// Writes a freelist page listing `ids` (ascending); returns its id.
    fn freelist_page(&mut self, ids: &[u64]) -> Result<u64, BoltError> {
        let mut body = Vec::with_capacity(8 * (ids.len() + 1));
        let count = match u16::try_from(ids.len()) {
            Ok(n) if n < FREELIST_COUNT_IN_BODY => n,
            _ => {
                body.extend_from_slice(&(ids.len() as u64).to_le_bytes());
                FREELIST_COUNT_IN_BODY
            }
        };
        for id in ids {
            body.extend_from_slice(&id.to_le_bytes());
        }
        self.pages.write(FREELIST_PAGE, count, &body)
    }
}

/// Writes a new, compact bbolt file bucket by bucket from keys given in order, each B+tree built
/// bottom-up: [`NewFile::tree`] per bucket, then [`NewFile::finish`]. Tests only: it makes the
/// databases the reader, the patcher and the restore's checks are tested on (a restore patches
/// the fetched snapshot, [`Patcher`]).
#[cfg(test)]
pub struct NewFile {
    pages: Pages,
}

#[cfg(test)]
impl NewFile {
    /// Creates `path` for a database of `page_size`-byte pages.
    pub fn create(path: &Path, page_size: usize) -> Result<NewFile, BoltError> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
        // Pages 0 and 1 (meta) and 2 (freelist) are written last, when the roots are known.
        out.write_all(&vec![0u8; 3 * page_size])?;
        Ok(NewFile {
            pages: Pages {
                out,
                page_size,
                next: 3,
            },
        })
    }

    /// A builder for one bucket's tree; give it keys in ascending order.
    pub fn tree(&mut self) -> Tree<'_> {
        self.pages.tree()
    }

    /// Writes the top-level `buckets` (names ascending; roots from [`NewFile::tree`]), an empty
    /// freelist (page 2) and the meta pages for transaction `txid` (page 1; page 0 holds the one
    /// before). The file is not synced.
    pub fn finish(mut self, buckets: &[Bucket], txid: u64) -> Result<(), BoltError> {
        let root = self.pages.root(buckets)?;
        let Pages {
            out,
            page_size: ps,
            next,
        } = self.pages;
        let mut file = out.into_inner().map_err(|e| e.into_error())?;
        let mut freelist = vec![0u8; ps];
        freelist[..8].copy_from_slice(&2u64.to_le_bytes());
        freelist[8..10].copy_from_slice(&FREELIST_PAGE.to_le_bytes());
        let meta = |txid: u64| Meta {
            page_size: ps as u32,
            flags: 0,
            root,
            sequence: 0,
            freelist: 2,
            pages: next,
            txid,
        };
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&meta(txid.saturating_sub(1)).page(0))?;
        file.write_all(&meta(txid).page(1))?;
        file.write_all(&freelist)?;
        file.flush()?;
        Ok(())
    }
}

/// Fills pages of one kind with elements.
struct Packer {
    flags: u16,
    /// Per element: (leaf flags, key size, value size or child page, offset of its data).
    elements: Vec<(u32, usize, u64, usize)>,
    data: Vec<u8>,
    first: Option<Vec<u8>>,
}

impl Packer {
    fn new(flags: u16) -> Packer {
        Packer {
            flags,
            elements: Vec::new(),
            data: Vec::new(),
            first: None,
        }
    }

    fn len(&self) -> usize {
        HEADER + self.elements.len() * ELEMENT + self.data.len()
    }

    /// Whether an element with `bytes` of key and value still fits in the current page (an
    /// empty page takes anything: a large value gets overflow pages).
    fn fits(&self, bytes: usize, page_size: usize) -> bool {
        self.elements.is_empty()
            || (self.len() + ELEMENT + bytes <= page_size
                && self.elements.len() < usize::from(u16::MAX))
    }

    fn push(&mut self, flags: u32, key: &[u8], value: &[u8], child: u64) {
        if self.first.is_none() {
            self.first = Some(key.to_vec());
        }
        let size = if self.flags == LEAF_PAGE {
            value.len() as u64
        } else {
            child
        };
        self.elements
            .push((flags, key.len(), size, self.data.len()));
        self.data.extend_from_slice(key);
        self.data.extend_from_slice(value);
    }

    /// Writes the current page; returns (its first key, its id).
    fn flush(&mut self, pages: &mut Pages) -> Result<(Vec<u8>, u64), BoltError> {
        let count = self.elements.len();
        let mut body = Vec::with_capacity(count * ELEMENT + self.data.len());
        for (i, &(flags, ksize, size, offset)) in self.elements.iter().enumerate() {
            // From the element's own position to its key.
            let pos = (count - i) * ELEMENT + offset;
            if self.flags == LEAF_PAGE {
                body.extend_from_slice(&flags.to_le_bytes());
                body.extend_from_slice(&(pos as u32).to_le_bytes());
                body.extend_from_slice(&(ksize as u32).to_le_bytes());
                body.extend_from_slice(&(size as u32).to_le_bytes());
            } else {
                body.extend_from_slice(&(pos as u32).to_le_bytes());
                body.extend_from_slice(&(ksize as u32).to_le_bytes());
                body.extend_from_slice(&size.to_le_bytes());
            }
        }
        body.extend_from_slice(&self.data);
        let id = pages.write(self.flags, count as u16, &body)?;
        self.elements.clear();
        self.data.clear();
        Ok((self.first.take().unwrap_or_default(), id))
    }
}

/// One bucket's tree being written: leaves as keys arrive, branches at the end.
pub struct Tree<'w> {
    pages: &'w mut Pages,
    leaf: Packer,
    /// First key and page of every leaf written.
    children: Vec<(Vec<u8>, u64)>,
    last: Option<Vec<u8>>,
    /// An extended tree's branch elements left of its rightmost path, bottom-up: level `i`
    /// goes before the pages written at level `i`.
    prefixes: Vec<Vec<(Vec<u8>, u64)>>,
}

impl Tree<'_> {
    /// Adds a key; keys must come in strictly ascending order.
    pub fn push(&mut self, key: &[u8], value: &[u8]) -> Result<(), BoltError> {
        self.push_element(0, key, value)
    }

    fn push_element(&mut self, flags: u32, key: &[u8], value: &[u8]) -> Result<(), BoltError> {
        if key.is_empty() {
            return Err(BoltError::Unsupported("an empty key".into()));
        }
        if let Some(last) = &self.last
            && key <= last.as_slice()
        {
            return Err(BoltError::Unsupported(format!(
                "keys out of order: {:?} after {:?}",
                String::from_utf8_lossy(key),
                String::from_utf8_lossy(last)
            )));
        }
        self.last = Some(key.to_vec());
        if !self
            .leaf
            .fits(key.len() + value.len(), self.pages.page_size)
        {
            let written = self.leaf.flush(self.pages)?;
            self.children.push(written);
        }
        self.leaf.push(flags, key, value, 0);
        Ok(())
    }

    /// Writes what is left and the branch pages; returns the root page.
    pub fn finish(mut self) -> Result<u64, BoltError> {
        // An empty bucket is one empty leaf.
        if !self.leaf.elements.is_empty() || self.children.is_empty() {
            let written = self.leaf.flush(self.pages)?;
            self.children.push(written);
        }
        let mut level = std::mem::take(&mut self.children);
        let mut prefixes = std::mem::take(&mut self.prefixes).into_iter();
        loop {
            match prefixes.next() {
                Some(mut prefix) => {
                    prefix.append(&mut level);
                    level = prefix;
                }
                None if level.len() <= 1 => break,
                None => {}
            }
            let mut branch = Packer::new(BRANCH_PAGE);
            let mut up = Vec::new();
            for (key, child) in &level {
                if !branch.fits(key.len(), self.pages.page_size) {
                    up.push(branch.flush(self.pages)?);
                }
                branch.push(0, key, &[], *child);
            }
            up.push(branch.flush(self.pages)?);
            level = up;
        }
        Ok(level[0].1)
    }
}

/// Hand-made bbolt files the tests and the fuzz seeds craft, pages given one by one.
#[cfg(test)]
pub(crate) mod crafted {
    use super::*;

    /// A page of `ps` bytes: the header (`id`, `flags`, `overflow`) and `elements`, each (leaf
    /// flags, key, value) in a leaf or (key, child) in a branch.
    pub fn page(
        ps: usize,
        id: u64,
        flags: u16,
        overflow: u32,
        leaf: &[(u32, Vec<u8>, Vec<u8>)],
        branch: &[(Vec<u8>, u64)],
    ) -> Vec<u8> {
        let mut page = vec![0u8; ps];
        let count = leaf.len() + branch.len();
        page[..8].copy_from_slice(&id.to_le_bytes());
        page[8..10].copy_from_slice(&flags.to_le_bytes());
        page[10..12].copy_from_slice(&(count as u16).to_le_bytes());
        page[12..16].copy_from_slice(&overflow.to_le_bytes());
        let mut data = HEADER + count * ELEMENT;
        for (i, (f, k, v)) in leaf.iter().enumerate() {
            let e = HEADER + i * ELEMENT;
            let fields = [*f, (data - e) as u32, k.len() as u32, v.len() as u32];
            for (j, n) in fields.into_iter().enumerate() {
                page[e + 4 * j..e + 4 * j + 4].copy_from_slice(&n.to_le_bytes());
            }
            page[data..data + k.len()].copy_from_slice(k);
            page[data + k.len()..data + k.len() + v.len()].copy_from_slice(v);
            data += k.len() + v.len();
        }
        for (i, (k, child)) in branch.iter().enumerate() {
            let e = HEADER + i * ELEMENT;
            page[e..e + 4].copy_from_slice(&((data - e) as u32).to_le_bytes());
            page[e + 4..e + 8].copy_from_slice(&(k.len() as u32).to_le_bytes());
            page[e + 8..e + 16].copy_from_slice(&child.to_le_bytes());
            page[data..data + k.len()].copy_from_slice(k);
            data += k.len();
        }
        page
    }

    /// A database of `pages` pages of `ps` bytes: meta pages for a root bucket at page 3 and an
    /// empty freelist at page 2, then `body` (pages 3 on, each a [`page`]), the rest zero.
    pub fn db(ps: usize, pages: u64, body: Vec<Vec<u8>>) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(pages as usize * ps);
        let meta = |txid| Meta {
            page_size: ps as u32,
            flags: 0,
            root: 3,
            sequence: 0,
            freelist: 2,
            pages,
            txid,
        };
        bytes.extend_from_slice(&meta(1).page(0));
        bytes.extend_from_slice(&meta(2).page(1));
        bytes.extend_from_slice(&page(ps, 2, FREELIST_PAGE, 0, &[], &[]));
        for p in body {
            bytes.extend_from_slice(&p);
        }
        bytes.resize(pages as usize * ps, 0);
        bytes
    }

    /// The root bucket's leaf (page 3): `names` each a bucket whose tree starts at page `root`.
    pub fn root_leaf(ps: usize, names: &[Vec<u8>], root: u64) -> Vec<u8> {
        let elements: Vec<_> = names
            .iter()
            .map(|n| (BUCKET_VALUE, n.clone(), bucket_value(root, 0).to_vec()))
            .collect();
        page(ps, 3, LEAF_PAGE, 0, &elements, &[])
    }

    /// The crafted snapshot, small: the `key` bucket a branch (page 4) over `leaves`
    /// leaves, each claiming as overflow every page to the end of the file.
    pub fn overflow_leaves(ps: usize, leaves: u64) -> Vec<u8> {
        let pages = 5 + leaves;
        let mut body = vec![root_leaf(ps, &[b"key".to_vec()], 4)];
        let children: Vec<(Vec<u8>, u64)> = (0..leaves)
            .map(|i| (i.to_be_bytes().to_vec(), 5 + i))
            .collect();
        body.push(page(ps, 4, BRANCH_PAGE, 0, &[], &children));
        for i in 0..leaves {
            let id = 5 + i;
            let overflow = (pages - 1 - id) as u32;
            let element = (0, i.to_be_bytes().to_vec(), b"v".to_vec());
            body.push(page(ps, id, LEAF_PAGE, overflow, &[element], &[]));
        }
        db(ps, pages, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

    /// A bbolt file `db` holding `buckets`, in a new temporary directory.
    fn written(buckets: &[(&[u8], Pairs)]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let mut w = NewFile::create(&path, 4096).unwrap();
        let mut roots = Vec::new();
        for (name, keys) in buckets {
            let mut t = w.tree();
            for (k, v) in keys {
                t.push(k, v).unwrap();
            }
            roots.push(Bucket {
                name: name.to_vec(),
                sequence: 7,
                root: Root::Page(t.finish().unwrap()),
            });
        }
        w.finish(&roots, 5).unwrap();
        (dir, path)
    }

    fn read_all(r: &Reader, root: &Root) -> Pairs {
        let mut out = Vec::new();
        r.visit(root, &mut |flags, k, v| {
            assert_eq!(flags, 0);
            out.push((k.to_vec(), v.to_vec()));
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn what_is_written_reads_back_in_order_across_branches_and_overflow() {
        // Enough small keys for two levels of branches, some values larger than a page.
        let many: Pairs = (0..60_000u32)
            .map(|i| {
                let v = if i % 997 == 0 {
                    vec![i as u8; 10_000]
                } else {
                    i.to_be_bytes().to_vec()
                };
                (format!("k{i:08}").into_bytes(), v)
            })
            .collect();
        let few = vec![(b"a".to_vec(), b"1".to_vec())];
        let (_dir, path) = written(&[
            (b"empty", vec![]),
            (b"key", many.clone()),
            (b"meta", few.clone()),
        ]);
        let len = std::fs::metadata(&path).unwrap().len();
        assert_eq!(len % 4096, 0);
        let r = Reader::open(&path, len).unwrap();
        assert_eq!(r.txid(), 5);
        let buckets = r.buckets().unwrap();
        let names: Vec<&[u8]> = buckets.iter().map(|b| b.name.as_slice()).collect();
        assert_eq!(names, [&b"empty"[..], b"key", b"meta"]);
        assert!(buckets.iter().all(|b| b.sequence == 7));
        assert!(read_all(&r, &buckets[0].root).is_empty());
        assert_eq!(read_all(&r, &buckets[1].root), many);
        assert_eq!(read_all(&r, &buckets[2].root), few);
        assert_eq!(
            r.last_key(&buckets[1].root).unwrap(),
            Some(b"k00059999".to_vec())
        );
        assert_eq!(r.last_key(&buckets[0].root).unwrap(), None);
        assert_eq!(r.get(&buckets[2].root, b"a").unwrap(), Some(b"1".to_vec()));
    }

    #[test]
    fn a_damaged_file_gives_errors_never_a_panic() {
        // Small, so each of the ~1,000 damaged copies is quick; still branches and overflow.
        let keys: Pairs = (0..1500u32)
            .map(|i| {
                let len = if i % 500 == 0 { 5000 } else { 20 };
                (i.to_be_bytes().to_vec(), vec![i as u8; len])
            })
            .collect();
        let (dir, path) = written(&[(b"key", keys), (b"meta", vec![])]);
        let good = std::fs::read(&path).unwrap();
        let broken = dir.path().join("broken");
        // Every 97th byte in turn, so every kind of field gets hit somewhere.
        for at in (0..good.len()).step_by(97) {
            let mut bytes = good.clone();
            bytes[at] ^= 0xff;
            std::fs::write(&broken, &bytes).unwrap();
            let Ok(r) = Reader::open(&broken, bytes.len() as u64) else {
                continue;
            };
            if let Ok(buckets) = r.buckets() {
                for b in buckets {
                    let _ = r.visit(&b.root, &mut |_, _, _| Ok(()));
                    let _ = r.last_key(&b.root);
                }
            }
        }
    }

    #[test]
    fn a_page_pointing_back_into_its_tree_is_refused() {
        let keys: Pairs = (0..2000u32)
            .map(|i| (i.to_be_bytes().to_vec(), vec![0; 100]))
            .collect();
        let (_dir, path) = written(&[(b"key", keys)]);
        let len = std::fs::metadata(&path).unwrap().len();
        let root = match &Reader::open(&path, len).unwrap().buckets().unwrap()[0].root {
            Root::Page(id) => *id,
            Root::Inline(_) => panic!("2000 keys make a tree"),
        };
        // The root branch's every child becomes the root itself: without a guard, a walk of
        // 32 levels with this fan-out would never end.
        let mut bytes = std::fs::read(&path).unwrap();
        let page = &mut bytes[root as usize * 4096..][..4096];
        assert_eq!(u16_at(page, 8), BRANCH_PAGE);
        for i in 0..usize::from(u16_at(page, 10)) {
            let e = HEADER + i * ELEMENT + 8;
            page[e..e + 8].copy_from_slice(&root.to_le_bytes());
        }
        std::fs::write(&path, &bytes).unwrap();
        let r = Reader::open(&path, len).unwrap();
        let e = r
            .visit(&Root::Page(root), &mut |_, _, _| Ok(()))
            .unwrap_err();
        assert!(e.to_string().contains("reached twice"), "{e}");
    }

    /// Rewrites both meta pages of the file at `path` to say no freelist is stored, as etcd's
    /// snapshots do.
    fn drop_stored_freelist(path: &Path) {
        let mut bytes = std::fs::read(path).unwrap();
        for id in 0..2u64 {
            let at = id as usize * 4096;
            let meta = Meta::parse(&bytes[at..at + 4096]).unwrap();
            let page = Meta {
                freelist: NO_FREELIST,
                ..meta
            }
            .page(id);
            bytes[at..at + 4096].copy_from_slice(&page);
        }
        std::fs::write(path, &bytes).unwrap();
    }

    /// Every bucket of the file at `path`, and its check.
    fn contents(path: &Path) -> (Vec<(Vec<u8>, Pairs)>, Check, u64) {
        let len = std::fs::metadata(path).unwrap().len();
        let r = Reader::open(path, len).unwrap();
        let check = r.check().unwrap_or_else(|e| panic!("inconsistent: {e}"));
        assert_eq!(len, check.pages * 4096, "the file ends after the last page");
        let buckets = r
            .buckets()
            .unwrap()
            .into_iter()
            .map(|b| (b.name.clone(), read_all(&r, &b.root)))
            .collect();
        (buckets, check, r.txid())
    }

    /// A value of `len` bytes that tells its key.
    fn value(i: u64, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i as usize + j) as u8).collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// Patches in a row, each adding keys after a bucket's last (some larger than a page,
        /// enough for new branch levels), replacing a small bucket and leaving one alone: after
        /// every commit the file holds exactly the model's keys, is consistent as `bbolt check`
        /// sees it (no page both used and free, none reached twice), in both freelist forms.
        #[test]
        fn patches_keep_the_file_consistent_and_equal_to_the_model(
            initial in 0usize..3000,
            rounds in proptest::collection::vec((0usize..6000, 0u8..4, proptest::bool::ANY), 1..4),
            stored_freelist in proptest::bool::ANY,
        ) {
            let mut model: Vec<(Vec<u8>, Pairs)> = vec![
                (b"a".to_vec(), (0..50u64).map(|i| (i.to_be_bytes().to_vec(), value(i, 30))).collect()),
                (b"key".to_vec(), (0..initial as u64).map(|i| (i.to_be_bytes().to_vec(), value(i, 40))).collect()),
                (b"meta".to_vec(), vec![(b"x".to_vec(), b"1".to_vec())]),
            ];
            let named: Vec<(&[u8], Pairs)> = model.iter().map(|(n, p)| (n.as_slice(), p.clone())).collect();
            let (_dir, path) = written(&named);
            if !stored_freelist {
                drop_stored_freelist(&path);
            }
            let mut next = initial as u64;
            for (txid, (round, (add, big_every, replace_meta))) in (6..).zip(rounds.into_iter().enumerate()) {
                let len = std::fs::metadata(&path).unwrap().len();
                let r = Reader::open(&path, len).unwrap();
                let buckets = r.buckets().unwrap();
                let a_root = buckets[0].root.clone();
                let mut w = Patcher::open(&path, &r).unwrap();
                let mut values = Vec::new();
                for b in &buckets {
                    let v = match b.name.as_slice() {
                        b"key" => {
                            let mut t = w.extend(&b.root).unwrap();
                            for _ in 0..add {
                                let big = big_every > 0 && next.is_multiple_of(97 * u64::from(big_every));
                                let (k, v) = (next.to_be_bytes().to_vec(), value(next, if big { 9000 } else { 40 }));
                                t.push(&k, &v).unwrap();
                                model[1].1.push((k, v));
                                next += 1;
                            }
                            // A key not after the last is refused, as in a new tree.
                            if next > 0 {
                                proptest::prop_assert!(t.push(&(next - 1).to_be_bytes(), b"").is_err());
                            }
                            Bucket { root: Root::Page(t.finish().unwrap()), ..b.clone() }
                        }
                        b"meta" if replace_meta => {
                            let mut t = w.replace(&b.root).unwrap();
                            let k = format!("round{round}").into_bytes();
                            t.push(&k, b"v").unwrap();
                            model[2].1 = vec![(k, b"v".to_vec())];
                            Bucket { root: Root::Page(t.finish().unwrap()), ..b.clone() }
                        }
                        _ => b.clone(),
                    };
                    values.push(v);
                }
                w.commit(&values).unwrap();
                let (got, check, got_txid) = contents(&path);
                proptest::prop_assert_eq!(got_txid, txid);
                proptest::prop_assert!(got == model, "round {}: contents differ from the model", round);
                if stored_freelist {
                    proptest::prop_assert!(check.free > 0, "the replaced pages are listed free");
                }
                // The untouched bucket kept its pages.
                let len = std::fs::metadata(&path).unwrap().len();
                let r = Reader::open(&path, len).unwrap();
                proptest::prop_assert_eq!(&r.buckets().unwrap()[0].root, &a_root);
            }
        }
    }

    #[test]
    fn an_inline_bucket_is_extended_into_pages() {
        let few: Pairs = (0..5u8).map(|i| (vec![b'k', i], vec![i; 10])).collect();
        let (_dir, path) = written(&[(b"key", few.clone())]);
        let len = std::fs::metadata(&path).unwrap().len();
        let r = Reader::open(&path, len).unwrap();
        let bucket = r.buckets().unwrap().remove(0);
        let Root::Page(leaf) = bucket.root else {
            panic!("the writer writes pages")
        };
        // First patch: the bucket made inline (its one leaf in the root bucket's value), as
        // bbolt stores a small bucket.
        let mut page = vec![0u8; 4096];
        r.file.read_exact_at(&mut page, leaf * 4096).unwrap();
        let inline = Bucket {
            root: Root::Inline(page),
            ..bucket.clone()
        };
        let mut w = Patcher::open(&path, &r).unwrap();
        w.free([leaf]);
        w.commit(&[inline]).unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        let r = Reader::open(&path, len).unwrap();
        let bucket = r.buckets().unwrap().remove(0);
        assert!(matches!(bucket.root, Root::Inline(_)));
        assert_eq!(read_all(&r, &bucket.root), few);
        // Second patch: keys added after its last; it becomes a tree of pages.
        let mut w = Patcher::open(&path, &r).unwrap();
        let mut t = w.extend(&bucket.root).unwrap();
        let mut all = few;
        for i in 0..3000u32 {
            let (k, v) = (format!("m{i:05}").into_bytes(), vec![1; 20]);
            t.push(&k, &v).unwrap();
            all.push((k, v));
        }
        let root = t.finish().unwrap();
        w.commit(&[Bucket {
            root: Root::Page(root),
            ..bucket
        }])
        .unwrap();
        let (got, _, _) = contents(&path);
        assert_eq!(got, vec![(b"key".to_vec(), all)]);
    }

    #[test]
    fn the_check_finds_a_page_both_used_and_free_and_one_lost() {
        let keys: Pairs = (0..2000u32)
            .map(|i| (i.to_be_bytes().to_vec(), vec![0; 100]))
            .collect();
        let (_dir, path) = written(&[(b"key", keys)]);
        let len = std::fs::metadata(&path).unwrap().len();
        let r = Reader::open(&path, len).unwrap();
        assert_eq!(
            r.check().unwrap(),
            Check {
                pages: len / 4096,
                used: len / 4096 - 2,
                free: 0
            }
        );
        let used = r.tree_pages(&r.buckets().unwrap()[0].root).unwrap()[3];
        // The freelist (page 2) lists a page a tree uses.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[2 * 4096 + 10..2 * 4096 + 12].copy_from_slice(&1u16.to_le_bytes());
        bytes[2 * 4096 + HEADER..2 * 4096 + HEADER + 8].copy_from_slice(&used.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let e = Reader::open(&path, len).unwrap().check().unwrap_err();
        assert!(e.to_string().contains("also used"), "{e}");
        // A page past the last one, neither used nor free: the high-water mark raised by one.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[2 * 4096 + 10..2 * 4096 + 12].copy_from_slice(&0u16.to_le_bytes());
        for id in 0..2u64 {
            let at = id as usize * 4096;
            let meta = Meta::parse(&bytes[at..at + 4096]).unwrap();
            let page = Meta {
                pages: meta.pages + 1,
                ..meta
            }
            .page(id);
            bytes[at..at + 4096].copy_from_slice(&page);
        }
        bytes.extend_from_slice(&[0; 4096]);
        std::fs::write(&path, &bytes).unwrap();
        let e = Reader::open(&path, len + 4096)
            .unwrap()
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("neither used nor free"), "{e}");
    }

    /// `bytes` as the file `db` in a new temporary directory.
    fn on_disk(bytes: Vec<u8>) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        std::fs::write(&path, bytes).unwrap();
        (dir, path)
    }

    /// One walk of a tree by a reader.
    type Walk = fn(&Reader, &Root) -> Result<(), BoltError>;

    /// The crafted snapshot, small: the `key` bucket a branch (page 4) over 150 leaves,
    /// each claiming as overflow every page to the end of the file. Each leaf was read whole,
    /// its overflow only read, never marked: 150 leaves cost ~11,000 page reads for a 155-page
    /// file (65,535 leaves in 258 MiB kept a restore busy for hours). Every walk now marks a
    /// page's whole range seen before reading its overflow: the second leaf, inside the first's
    /// range, is refused after one page.
    #[test]
    fn leaves_claiming_the_file_as_overflow_are_read_at_most_once() {
        let leaves = 150u64;
        let pages = 5 + leaves;
        let (_dir, path) = on_disk(crafted::overflow_leaves(4096, leaves));
        let len = pages * 4096;

        let walks: [(&str, Walk); 3] = [
            ("visit", |r, root| r.visit(root, &mut |_, _, _| Ok(()))),
            ("tree_pages", |r, root| r.tree_pages(root).map(drop)),
            ("check", |r, _| r.check().map(drop)),
        ];
        for (name, walk) in walks {
            let r = Reader::open(&path, len).unwrap();
            let root = r.buckets().unwrap().remove(0).root;
            let before = r.pages_read();
            let walked = walk(&r, &root);
            let read = r.pages_read() - before;
            assert!(
                read <= pages + 1,
                "{name}: {read} page reads for a {pages}-page file"
            );
            let e = walked.unwrap_err();
            assert!(e.to_string().contains("reached twice"), "{name}: {e}");
        }
    }

    /// The rightmost path's variant: a chain of 30 branch pages, each with one child (the next)
    /// and claiming the rest of the file as overflow, was read 30 times over by `last_key` and by
    /// the patcher's `extend`.
    #[test]
    fn a_rightmost_path_claiming_the_file_as_overflow_is_read_once() {
        let depth = 30u64;
        let pages = 4 + depth + 1;
        let mut body = vec![crafted::root_leaf(4096, &[b"key".to_vec()], 4)];
        for id in 4..4 + depth {
            let overflow = (pages - 1 - id) as u32;
            body.push(crafted::page(
                4096,
                id,
                BRANCH_PAGE,
                overflow,
                &[],
                &[(b"k".to_vec(), id + 1)],
            ));
        }
        let element = (0, b"k".to_vec(), b"v".to_vec());
        body.push(crafted::page(
            4096,
            4 + depth,
            LEAF_PAGE,
            0,
            &[element],
            &[],
        ));
        let (_dir, path) = on_disk(crafted::db(4096, pages, body));
        let len = pages * 4096;
        for name in ["last_key", "right_spine"] {
            let r = Reader::open(&path, len).unwrap();
            let root = r.buckets().unwrap().remove(0).root;
            let before = r.pages_read();
            let walked = match name {
                "last_key" => r.last_key(&root).map(drop),
                _ => r.right_spine(&root).map(drop),
            };
            let read = r.pages_read() - before;
            assert!(
                read <= pages + 1,
                "{name}: {read} page reads for {pages} pages"
            );
            let e = walked.unwrap_err();
            assert!(e.to_string().contains("reached twice"), "{name}: {e}");
        }
    }

    /// Many buckets sharing one tree (each walk alone legal: no page twice in it): walking every
    /// bucket, as a full validation of a data directory does, read the tree once per bucket.
    /// A reader stops once it has read [`READ_PASSES`] times the file's pages.
    #[test]
    fn a_reader_reads_at_most_a_bounded_multiple_of_its_file() {
        let leaves = 20u64;
        let pages = 5 + leaves;
        let names: Vec<Vec<u8>> = (0..100u32)
            .map(|i| format!("b{i:03}").into_bytes())
            .collect();
        let mut body = vec![crafted::root_leaf(4096, &names, 4)];
        let children: Vec<(Vec<u8>, u64)> = (0..leaves)
            .map(|i| (i.to_be_bytes().to_vec(), 5 + i))
            .collect();
        body.push(crafted::page(4096, 4, BRANCH_PAGE, 0, &[], &children));
        for i in 0..leaves {
            let element = (0, i.to_be_bytes().to_vec(), b"v".to_vec());
            body.push(crafted::page(4096, 5 + i, LEAF_PAGE, 0, &[element], &[]));
        }
        let (_dir, path) = on_disk(crafted::db(4096, pages, body));
        let r = Reader::open(&path, pages * 4096).unwrap();
        let buckets = r.buckets().unwrap();
        assert_eq!(buckets.len(), 100);
        let mut refused = None;
        for b in &buckets {
            if let Err(e) = r.visit(&b.root, &mut |_, _, _| Ok(())) {
                refused = Some(e);
                break;
            }
        }
        let bound = READ_PASSES * pages + READ_SLACK;
        assert!(
            r.pages_read() <= bound + 1,
            "{} page reads, bound {bound}",
            r.pages_read()
        );
        let e = refused.expect("100 walks of one 21-page tree are refused");
        assert!(e.to_string().contains("over and over"), "{e}");
    }

    /// A reader whose restore was dropped (a signal) stops at its next page: the thread a
    /// restore patches the database in is not left running for the whole walk.
    #[test]
    fn a_cancelled_reader_stops_at_the_next_page() {
        let keys: Pairs = (0..2000u32)
            .map(|i| (i.to_be_bytes().to_vec(), vec![0; 100]))
            .collect();
        let (_dir, path) = written(&[(b"key", keys)]);
        let len = std::fs::metadata(&path).unwrap().len();
        let cancel = CancellationToken::new();
        let r = Reader::open(&path, len).unwrap().cancel_on(cancel.clone());
        let root = r.buckets().unwrap().remove(0).root;
        let before = r.pages_read();
        let mut seen = 0;
        let visited = r.visit(&root, &mut |_, _, _| {
            seen += 1;
            cancel.cancel();
            Ok(())
        });
        // The root branch and the first leaf; no page after the cancel.
        assert_eq!(r.pages_read() - before, 2, "{seen} elements visited");
        assert!(matches!(visited, Err(BoltError::Cancelled)), "{visited:?}");
    }

    #[test]
    fn keys_out_of_order_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = NewFile::create(&dir.path().join("db"), 4096).unwrap();
        let mut t = w.tree();
        t.push(b"b", b"").unwrap();
        assert!(matches!(t.push(b"a", b""), Err(BoltError::Unsupported(_))));
        assert!(matches!(t.push(b"b", b""), Err(BoltError::Unsupported(_))));
    }

    #[test]
    fn damage_is_reported_not_followed() {
        let (dir, path) = written(&[(b"key", vec![(b"a".to_vec(), b"1".to_vec())])]);
        let len = std::fs::metadata(&path).unwrap().len();
        // Both meta pages broken: not a bbolt file.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[HEADER + 20] ^= 1;
        bytes[4096 + HEADER + 20] ^= 1;
        let broken = dir.path().join("broken");
        std::fs::write(&broken, &bytes).unwrap();
        assert!(matches!(
            Reader::open(&broken, len),
            Err(BoltError::Corrupt(_))
        ));
        // One meta page broken: the other one serves.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096 + HEADER + 20] ^= 1;
        std::fs::write(&broken, &bytes).unwrap();
        let r = Reader::open(&broken, len).unwrap();
        assert_eq!(r.txid(), 4);
        assert_eq!(r.buckets().unwrap().len(), 1);
        // Truncated: the pages do not fit.
        assert!(matches!(
            Reader::open(&path, len - 4096),
            Err(BoltError::Corrupt(_))
        ));
    }
}
