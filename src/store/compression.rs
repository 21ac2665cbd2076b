//! Payload compression: the codecs etcd-backup-restore names by suffix (`.gz`, `.zlib`, `.Z`, none),
//! as streaming encoders and decoders over byte streams with bounded memory.
//!
//! Gzip is compressed in parallel as independent gzip members, one per block: a concatenation of
//! members is one valid gzip file for Go's `gzip.Reader` (multistream by default) and for
//! `MultiGzDecoder`. Each member's header states its stored and inflated sizes in a subfield of
//! its extra field (the format: `gzip_members`), so it is inflated in parallel too: the decoder
//! reads the first member's header, and when it states its sizes, cuts the file into whole
//! members by them and inflates up to `available_parallelism` at once, in order, every statement
//! checked. Gzip without that subfield (etcd-backup-restore's one member, etcd-warden's snapshots
//! before it) is inflated as one stream on one thread, as before. Zlib has no such property (Go's
//! reader stops after the first stream), so it is compressed sequentially. LZW (`.Z`, Go's `compress/lzw` with LSB order and literal width 8, no
//! header) is readable only, as the reference's default has always been gzip.

use std::fmt;
use std::io::{self, Read, Write};
use std::str::FromStr;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::gzip_members::{self, Head};

/// Size of one gzip member, and of the chunks the sequential codecs emit.
const BLOCK: usize = 1 << 20;
/// Bytes read from a decoder at a time.
const READ_CHUNK: usize = 256 << 10;
/// Go's `compress/lzw` literal width used by the reference.
const LZW_LITERAL_WIDTH: u8 = 8;

/// A byte stream: what flows from etcd, through a codec, into the store, and back.
pub type ByteStream = BoxStream<'static, io::Result<Bytes>>;

/// A payload codec, named in a snapshot's name by its suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Codec {
    /// No compression: suffix "".
    None,
    /// gzip: suffix ".gz" (the default).
    #[default]
    Gzip,
    /// zlib: suffix ".zlib".
    Zlib,
    /// Go's LZW: suffix ".Z" (read only).
    Lzw,
}

/// The deflate level of gzip and zlib: configuration's (`snapshot.compression_level`).
pub use crate::config::CompressionLevel as Level;

impl Level {
    /// As flate2 takes it.
    pub fn flate(self) -> flate2::Compression {
        flate2::Compression::new(self.get())
    }
}

/// Every codec, for tests and suffix lookups.
pub const ALL_CODECS: [Codec; 4] = [Codec::None, Codec::Gzip, Codec::Zlib, Codec::Lzw];

impl Codec {
    /// The suffix in snapshot names (Go: `GetCompressionSuffix`).
    pub fn suffix(self) -> &'static str {
        match self {
            Codec::None => "",
            Codec::Gzip => ".gz",
            Codec::Zlib => ".zlib",
            Codec::Lzw => ".Z",
        }
    }

    /// The codec a suffix names, `None` for an unknown suffix.
    pub fn from_suffix(suffix: &str) -> Option<Codec> {
        ALL_CODECS.into_iter().find(|c| c.suffix() == suffix)
    }

    /// Compresses a stream at `level`. Gzip runs on up to `parallelism` blocking threads;
    /// memory stays around `parallelism` × 2 MiB whatever the input size. Call within a Tokio
    /// runtime.
    pub fn encode(
        self,
        input: ByteStream,
        parallelism: usize,
        level: Level,
    ) -> Result<ByteStream, CodecError> {
        match self {
            Codec::None => Ok(input),
            Codec::Gzip => Ok(gzip_parallel(input, parallelism.max(1), level)),
            Codec::Zlib => Ok(blocking_transform(input, move |r| {
                Box::new(flate2::read::ZlibEncoder::new(r, level.flate()))
            })),
            Codec::Lzw => Err(CodecError::WriteUnsupported(self)),
        }
    }

    /// Decompresses a stream on blocking threads: etcd-warden's sized gzip members on as many as
    /// the machine has cores when it has at least [`PARALLEL_FROM`] ([`inflaters`]), anything
    /// else on one. Call within a Tokio runtime.
    pub fn decode(self, input: ByteStream) -> ByteStream {
        match self {
            Codec::None => input,
            Codec::Gzip => match inflaters(default_parallelism()) {
                Some(n) => gzip_decode(input, n),
                None => gzip_sequential(input),
            },
            Codec::Zlib => {
                blocking_transform(input, |r| Box::new(flate2::read::ZlibDecoder::new(r)))
            }
            Codec::Lzw => blocking_transform(input, |r| Box::new(LzwReader::new(r))),
        }
    }
}

impl From<crate::config::Compression> for Codec {
    fn from(c: crate::config::Compression) -> Codec {
        match c {
            crate::config::Compression::None => Codec::None,
            crate::config::Compression::Gzip => Codec::Gzip,
            crate::config::Compression::Zlib => Codec::Zlib,
        }
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Codec::None => "none",
            Codec::Gzip => "gzip",
            Codec::Zlib => "zlib",
            Codec::Lzw => "lzw",
        })
    }
}

impl From<Codec> for String {
    fn from(c: Codec) -> String {
        c.suffix().to_string()
    }
}

impl TryFrom<String> for Codec {
    type Error = CodecError;
    fn try_from(s: String) -> Result<Codec, CodecError> {
        s.parse()
    }
}

impl FromStr for Codec {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Codec, CodecError> {
        Codec::from_suffix(s).ok_or_else(|| CodecError::UnknownSuffix(s.to_string()))
    }
}

/// Codec errors.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The suffix names no known compression.
    #[error("unknown compression suffix {0:?}; one of \".gz\", \".zlib\", \".Z\" or none")]
    UnknownSuffix(String),
    /// Writing this codec is not supported.
    #[error("writing {0} snapshots is not supported (they are readable)")]
    WriteUnsupported(Codec),
}

/// Gzip in independent members of [`BLOCK`] bytes, compressed on blocking threads, emitted in
/// order. Blocks are read ahead on a task so the source keeps streaming while earlier blocks
/// compress; at most `parallelism` blocks are compressing and as many are read ahead.
fn gzip_parallel(input: ByteStream, parallelism: usize, level: Level) -> ByteStream {
    prefetch(at_least_one(rechunk(input, BLOCK)), parallelism)
        .map(move |block| async move {
            let block = block?;
            tokio::task::spawn_blocking(move || gzip_member(&block, level))
                .await
                .unwrap_or_else(|join| Err(io::Error::other(join)))
        })
        .buffered(parallelism)
        .boxed()
}

/// What flows through the channels between a stream's producer task or thread and its consumer:
/// a chunk, or the producer saying it is done. A channel that closes without `End` means the
/// producer died (a panic in a compression thread, an aborted task): that is an error, never a
/// clean end, so a truncated payload can not be stored as a complete one.
enum Piece<T = Bytes> {
    Chunk(io::Result<T>),
    End,
}

fn abnormal_end() -> io::Error {
    io::Error::other("the stream's producer stopped without finishing (it panicked or was aborted)")
}

/// The consumer side of a [`Piece`] channel as a stream: ends at `End` or after an error; a
/// channel closed before either is an error.
fn pieces<T: Send + 'static>(
    mut rx: mpsc::Receiver<Piece<T>>,
    guard: AbortOnDrop,
) -> BoxStream<'static, io::Result<T>> {
    let mut done = false;
    futures::stream::poll_fn(move |cx| {
        let _keep = &guard;
        if done {
            return std::task::Poll::Ready(None);
        }
        let item = match rx.poll_recv(cx) {
            std::task::Poll::Pending => return std::task::Poll::Pending,
            std::task::Poll::Ready(Some(Piece::Chunk(Ok(b)))) => Some(Ok(b)),
            std::task::Poll::Ready(Some(Piece::Chunk(Err(e)))) => {
                done = true;
                Some(Err(e))
            }
            std::task::Poll::Ready(Some(Piece::End)) => {
                done = true;
                None
            }
            std::task::Poll::Ready(None) => {
                done = true;
                Some(Err(abnormal_end()))
            }
        };
        std::task::Poll::Ready(item)
    })
    .boxed()
}

/// Sends every item of `input` and then `End` (nothing after an error); stops early when the
/// receiver is gone.
async fn forward<T>(mut input: BoxStream<'static, io::Result<T>>, tx: mpsc::Sender<Piece<T>>) {
    loop {
        match input.next().await {
            Some(item) => {
                let failed = item.is_err();
                if tx.send(Piece::Chunk(item)).await.is_err() || failed {
                    return;
                }
            }
            None => {
                let _ = tx.send(Piece::End).await;
                return;
            }
        }
    }
}

/// Reads up to `depth` items of a stream ahead on a task, so a slow consumer does not stall
/// the producer (an etcd snapshot stream, a network download). Dropping the returned stream
/// stops the task. Must be called within a Tokio runtime.
pub fn prefetch(input: ByteStream, depth: usize) -> ByteStream {
    prefetch_items(input, depth)
}

/// [`prefetch`] for a stream of anything.
fn prefetch_items<T: Send + 'static>(
    input: BoxStream<'static, io::Result<T>>,
    depth: usize,
) -> BoxStream<'static, io::Result<T>> {
    let (tx, rx) = mpsc::channel::<Piece<T>>(depth.max(1));
    let task = tokio::spawn(forward(input, tx));
    pieces(rx, AbortOnDrop(task))
}

fn gzip_member(block: &[u8], level: Level) -> io::Result<Bytes> {
    let mut out = gzip_members::write(block, level.flate())?;
    if out.capacity() > out.len() + out.len() / 4 {
        out.shrink_to_fit();
    }
    Ok(Bytes::from(out))
}

/// Regroups a stream into chunks of exactly `size` bytes (the last one shorter).
pub fn rechunk(input: ByteStream, size: usize) -> ByteStream {
    futures::stream::unfold(
        (input, Vec::<u8>::with_capacity(size), false),
        move |(mut input, mut buf, mut ended)| async move {
            loop {
                if buf.len() >= size {
                    let rest = buf.split_off(size);
                    let full = std::mem::replace(&mut buf, rest);
                    return Some((Ok(Bytes::from(full)), (input, buf, ended)));
                }
                if ended {
                    if buf.is_empty() {
                        return None;
                    }
                    let last = std::mem::take(&mut buf);
                    return Some((Ok(Bytes::from(last)), (input, buf, ended)));
                }
                match input.next().await {
                    Some(Ok(b)) => buf.extend_from_slice(&b),
                    Some(Err(e)) => return Some((Err(e), (input, Vec::new(), true))),
                    None => ended = true,
                }
            }
        },
    )
    .boxed()
}

/// A stream that yields one empty chunk when `input` ends without any: an empty payload is
/// then one empty gzip member, a valid gzip file (GNU gzip refuses a file of no bytes).
fn at_least_one(input: ByteStream) -> ByteStream {
    let mut any = false;
    input
        .map(Some)
        .chain(futures::stream::once(futures::future::ready(None)))
        .filter_map(move |item| {
            let out = match item {
                Some(item) => Some(item),
                None if !any => Some(Ok(Bytes::new())),
                None => None,
            };
            any = true;
            futures::future::ready(out)
        })
        .boxed()
}

/// Cores to inflate on.
fn default_parallelism() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// The fewest cores on which gzip is inflated member by member in parallel. On 2 cores the
/// restore's other work (the database written, etcd's hash checked: about half its CPU time)
/// takes the second core, and the parallel path measured 0.95–1.36× the time of one stream on
/// the same file (docs/benchmarks.md, "Parallel inflate"), so it is not taken there.
pub const PARALLEL_FROM: usize = 3;

/// How many members to inflate at once on a machine of `cores`: `None` for one stream.
fn inflaters(cores: usize) -> Option<usize> {
    (cores >= PARALLEL_FROM).then_some(cores)
}

/// Gzip decoded: when the first member states its sizes, member by member in parallel
/// ([`gzip_members_parallel`]); otherwise, and for anything not gzip, as one stream.
fn gzip_decode(input: ByteStream, parallelism: usize) -> ByteStream {
    futures::stream::once(async move {
        let mut members = Members::new(input, 2 * parallelism.max(1) + 2);
        match members.head().await {
            Ok(Head::Sized { .. }) => gzip_members_parallel(members, parallelism),
            Ok(_) => gzip_sequential(members.into_rest()),
            Err(e) => futures::stream::once(futures::future::ready(Err(e))).boxed(),
        }
    })
    .flatten()
    .boxed()
}

/// Gzip as one stream of any number of members on one blocking thread.
fn gzip_sequential(input: ByteStream) -> ByteStream {
    blocking_transform(input, |r| Box::new(flate2::read::MultiGzDecoder::new(r)))
}

/// What the cutter hands the inflaters: a whole sized member, or the rest of the file from a
/// member without sizes on.
enum Unit {
    Member { offset: u64, bytes: Bytes },
    Rest { offset: u64, rest: ByteStream },
}

/// Where [`Members`] stands at a member boundary.
enum Cut {
    Member { offset: u64, bytes: Bytes },
    Unsized { offset: u64 },
    End,
}

/// Inflated output, in order: a member's bytes, or the rest's stream.
enum Inflated {
    Chunk(Bytes),
    Rest(ByteStream),
}

/// Sized members cut by [`Members`] (read ahead on a task, `parallelism` deep), inflated on up
/// to `parallelism` blocking threads at once and emitted in order. In flight: `parallelism`
/// members read ahead, `parallelism` inflating with their output (about `parallelism` × 2 MiB
/// for etcd-warden's 1 MiB blocks, at most `parallelism` × 2 × (16 + 17) MiB for members at the
/// caps). A member without sizes after sized ones (a valid gzip file: `cat` of two, say) is
/// decoded from there on as one stream, after everything before it: every gzip file decodes,
/// however it was put together. The stream ends at its first error.
fn gzip_members_parallel(members: Members, parallelism: usize) -> ByteStream {
    let parallelism = parallelism.max(1);
    let outputs = std::sync::Arc::new(Pool::new(2 * parallelism + 4));
    let units = futures::stream::unfold(Some(members), |state| async move {
        let mut members = state?;
        match members.next_cut().await {
            Ok(Cut::Member { offset, bytes }) => {
                Some((Ok(Unit::Member { offset, bytes }), Some(members)))
            }
            Ok(Cut::Unsized { offset }) => {
                let rest = members.into_rest();
                Some((Ok(Unit::Rest { offset, rest }), None))
            }
            Ok(Cut::End) => None,
            Err(e) => Some((Err(e), None)),
        }
    })
    .boxed();
    let inflated = prefetch_items(units, parallelism)
        .map(move |unit| {
            let outputs = outputs.clone();
            async move {
                match unit? {
                    Unit::Member { offset, bytes } => tokio::task::spawn_blocking(move || {
                        let mut buf = outputs.take(BLOCK + 1);
                        gzip_members::inflate(&bytes, offset, &mut buf)?;
                        let len = buf.len();
                        let pool = outputs;
                        Ok(Inflated::Chunk(Bytes::from_owner(Pooled {
                            buf,
                            len,
                            pool,
                        })))
                    })
                    .await
                    .unwrap_or_else(|join| Err(io::Error::other(join))),
                    Unit::Rest { offset, rest } => {
                        let rest = gzip_sequential(rest).map(move |r| {
                            r.map_err(|e| {
                                io::Error::new(
                                    e.kind(),
                                    format!("gzip stream from offset {offset}: {e}"),
                                )
                            })
                        });
                        Ok(Inflated::Rest(rest.boxed()))
                    }
                }
            }
        })
        .buffered(parallelism)
        .flat_map(|r| match r {
            Ok(Inflated::Chunk(b)) if b.is_empty() => futures::stream::empty().boxed(),
            Ok(Inflated::Chunk(b)) => once(b),
            Ok(Inflated::Rest(rest)) => rest,
            Err(e) => futures::stream::once(futures::future::ready(Err(e))).boxed(),
        })
        .boxed();
    ends_at_first_error(inflated)
}

/// Passes items on up to and including the first error, then ends.
fn ends_at_first_error(input: ByteStream) -> ByteStream {
    input
        .scan(false, |failed, item| {
            if *failed {
                return futures::future::ready(None);
            }
            *failed = item.is_err();
            futures::future::ready(Some(item))
        })
        .boxed()
}

/// The compressed input of [`gzip_decode`], cut into members by the sizes their headers state:
/// a queue of the input's chunks and the file offset of its first byte.
struct Members {
    input: ByteStream,
    chunks: std::collections::VecDeque<Bytes>,
    queued: usize,
    offset: u64,
    ended: bool,
    /// Buffers for members that span chunks (most do: chunks and members are both ~1 MiB).
    buffers: std::sync::Arc<Pool>,
}

impl Members {
    /// Over `input`, keeping up to `keep` member buffers for reuse.
    fn new(input: ByteStream, keep: usize) -> Self {
        Members {
            input,
            chunks: Default::default(),
            queued: 0,
            offset: 0,
            ended: false,
            buffers: std::sync::Arc::new(Pool::new(keep)),
        }
    }

    /// Reads until `n` bytes are queued or the input ends; whether they are.
    async fn fill(&mut self, n: usize) -> io::Result<bool> {
        while self.queued < n && !self.ended {
            match self.input.next().await {
                Some(Ok(b)) => {
                    self.queued += b.len();
                    if !b.is_empty() {
                        self.chunks.push_back(b);
                    }
                }
                Some(Err(e)) => return Err(e),
                None => self.ended = true,
            }
        }
        Ok(self.queued >= n)
    }

    /// The first `n` queued bytes (fewer if fewer are queued), copied only when they span chunks.
    fn peek(&self, n: usize) -> std::borrow::Cow<'_, [u8]> {
        let n = n.min(self.queued);
        match self.chunks.front() {
            Some(first) if first.len() >= n => std::borrow::Cow::Borrowed(&first[..n]),
            _ => {
                let mut v = Vec::with_capacity(n);
                for c in &self.chunks {
                    let want = (n - v.len()).min(c.len());
                    v.extend_from_slice(&c[..want]);
                    if v.len() == n {
                        break;
                    }
                }
                std::borrow::Cow::Owned(v)
            }
        }
    }

    /// Takes the first `n` queued bytes (there are at least `n`).
    fn take(&mut self, n: usize) -> Bytes {
        self.queued -= n;
        self.offset += n as u64;
        if let Some(first) = self.chunks.front_mut()
            && first.len() >= n
        {
            let out = first.split_to(n);
            if first.is_empty() {
                self.chunks.pop_front();
            }
            return out;
        }
        let mut buf = self.buffers.take(n);
        let mut filled = 0;
        while filled < n {
            let Some(first) = self.chunks.front_mut() else {
                break;
            };
            let want = (n - filled).min(first.len());
            buf[filled..filled + want].copy_from_slice(&first.split_to(want));
            filled += want;
            if first.is_empty() {
                self.chunks.pop_front();
            }
        }
        let pool = self.buffers.clone();
        Bytes::from_owner(Pooled { buf, len: n, pool })
    }

    /// What the next member's header says, reading as much as it takes (at most 64 KiB, the
    /// extra field's bound); `Short` only when the input ends before it can tell.
    async fn head(&mut self) -> io::Result<Head> {
        let mut need = 10;
        loop {
            let complete = self.fill(need).await?;
            match gzip_members::head(&self.peek(need)) {
                Head::Short(n) if complete => need = n,
                head => return Ok(head),
            }
        }
    }

    /// The next whole member, a member without sizes, or the end of the input.
    async fn next_cut(&mut self) -> io::Result<Cut> {
        let offset = self.offset;
        if !self.fill(1).await? {
            return Ok(Cut::End);
        }
        match self.head().await? {
            Head::Sized { sizes, extra_end } => {
                gzip_members::check_sizes(sizes, extra_end, offset)?;
                let stored = sizes.stored as usize;
                if !self.fill(stored).await? {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "gzip member at offset {offset}: its header states {stored} bytes, \
                             the input ends {} bytes into it",
                            self.queued
                        ),
                    ));
                }
                let bytes = self.take(stored);
                Ok(Cut::Member { offset, bytes })
            }
            Head::Unsized => Ok(Cut::Unsized { offset }),
            Head::NotGzip => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("offset {offset}: not a gzip member (no gzip magic and deflate method)"),
            )),
            Head::Short(_) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "gzip member at offset {offset}: the input ends {} bytes into its header",
                    self.queued
                ),
            )),
        }
    }

    /// What is queued and what the input has left, as one stream (an input that has ended is
    /// not polled again: many streams panic if they are).
    fn into_rest(self) -> ByteStream {
        let queued = futures::stream::iter(self.chunks.into_iter().map(Ok));
        match self.ended {
            true => queued.boxed(),
            false => queued.chain(self.input).boxed(),
        }
    }
}

/// Runs a `Read`-side transform (an encoder or decoder over a reader) on a blocking thread:
/// the input stream is fed through a bounded channel and the output comes back through another,
/// so at most a few chunks are held at once.
pub(super) fn blocking_transform<F>(input: ByteStream, make: F) -> ByteStream
where
    F: FnOnce(ChannelReader) -> Box<dyn Read + Send> + Send + 'static,
{
    let (in_tx, in_rx) = mpsc::channel::<Piece>(4);
    let (out_tx, out_rx) = mpsc::channel::<Piece>(4);
    // Feeding runs as a task so the caller only polls the output; it ends when the reader side is
    // dropped (send fails) or the input ends.
    let feeder = tokio::spawn(forward(input, in_tx));
    tokio::task::spawn_blocking(move || {
        let mut reader = make(ChannelReader::new(in_rx));
        let pool = std::sync::Arc::new(Pool::new(POOLED));
        loop {
            let mut buf = pool.take(READ_CHUNK);
            match read_full(&mut reader, &mut buf) {
                Ok(0) => {
                    let _ = out_tx.blocking_send(Piece::End);
                    break;
                }
                Ok(n) => {
                    let chunk = Bytes::from_owner(Pooled {
                        buf,
                        len: n,
                        pool: pool.clone(),
                    });
                    if out_tx.blocking_send(Piece::Chunk(Ok(chunk))).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = out_tx.blocking_send(Piece::Chunk(Err(e)));
                    break;
                }
            }
        }
    });
    pieces(out_rx, AbortOnDrop(feeder))
}

/// The output buffers of one [`blocking_transform`], reused once the consumer has dropped
/// them: a new buffer of [`READ_CHUNK`] is mapped fresh and faulted in page by page (the binary
/// maps every buffer of 128 KiB and more), which cost a 1 GiB restore ~1.9 s of kernel time.
/// It keeps what is in flight at most (the channels' depth), so memory stays as it was. The
/// parallel inflate pools its members and their output the same way.
struct Pool {
    free: std::sync::Mutex<Vec<Vec<u8>>>,
    keep: usize,
}

/// Buffers a sequential decoder's pool keeps: the output channel's depth, one being read by the
/// consumer, one being filled.
const POOLED: usize = 6;

impl Pool {
    /// A pool that keeps up to `keep` buffers.
    fn new(keep: usize) -> Self {
        Pool {
            free: Default::default(),
            keep,
        }
    }

    /// A buffer of `len` bytes (its contents are whatever it held).
    fn take(&self, len: usize) -> Vec<u8> {
        let reused = self.free.lock().map(|mut f| f.pop()).unwrap_or(None);
        let mut buf = reused.unwrap_or_default();
        buf.resize(len, 0);
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        if let Ok(mut free) = self.free.lock()
            && free.len() < self.keep
        {
            free.push(buf);
        }
    }
}

/// A chunk of a pooled buffer: its first `len` bytes; the buffer goes back when it is dropped.
struct Pooled {
    buf: Vec<u8>,
    len: usize,
    pool: std::sync::Arc<Pool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

/// Runs a `Write`-side transform (an encoder that writes into a writer) on a blocking thread:
/// `run` reads the input from the reader it is given and writes its output into the writer,
/// whose writes become the output stream's chunks. The output ends cleanly only when `run`
/// returns `Ok`; an error from it ends the stream with that error.
pub(super) fn blocking_pipe<F>(input: ByteStream, depth: usize, run: F) -> ByteStream
where
    F: FnOnce(&mut ChannelReader, &mut ChannelWriter) -> io::Result<()> + Send + 'static,
{
    let (in_tx, in_rx) = mpsc::channel::<Piece>(depth.max(1));
    let (out_tx, out_rx) = mpsc::channel::<Piece>(depth.max(1));
    let feeder = tokio::spawn(forward(input, in_tx));
    tokio::task::spawn_blocking(move || {
        let mut reader = ChannelReader::new(in_rx);
        let mut writer = ChannelWriter { tx: out_tx };
        let end = match run(&mut reader, &mut writer) {
            Ok(()) => Piece::End,
            Err(e) => Piece::Chunk(Err(e)),
        };
        let _ = writer.tx.blocking_send(end);
    });
    pieces(out_rx, AbortOnDrop(feeder))
}

/// A blocking `Write` into a channel of chunks (used only on blocking threads): each write is
/// one chunk, so callers put a `BufWriter` in front of it.
pub(super) struct ChannelWriter {
    tx: mpsc::Sender<Piece>,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tx
            .blocking_send(Piece::Chunk(Ok(Bytes::copy_from_slice(buf))))
            .map_err(|_| {
                io::Error::new(io::ErrorKind::BrokenPipe, "the output stream was dropped")
            })?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Aborts the feeding task when the output stream is dropped early.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads until `buf` is full or the reader ends, so chunks are large.
fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A blocking `Read` over a channel of chunks (used only on blocking threads); the channel
/// closing before its `End` is an error, not the end of the input.
pub struct ChannelReader {
    rx: mpsc::Receiver<Piece>,
    current: Bytes,
    ended: bool,
}

impl ChannelReader {
    fn new(rx: mpsc::Receiver<Piece>) -> Self {
        Self {
            rx,
            current: Bytes::new(),
            ended: false,
        }
    }
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            if self.ended {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Piece::Chunk(Ok(b))) => self.current = b,
                Some(Piece::Chunk(Err(e))) => return Err(e),
                Some(Piece::End) => self.ended = true,
                None => return Err(abnormal_end()),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// Go `compress/lzw` (LSB, literal width 8) decoding as a `Read`.
struct LzwReader<R> {
    inner: R,
    decoder: weezl::decode::Decoder,
    input: Vec<u8>,
    input_pos: usize,
    out: Vec<u8>,
    out_pos: usize,
    input_done: bool,
    finished: bool,
}

impl<R: Read> LzwReader<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            decoder: weezl::decode::Decoder::new(weezl::BitOrder::Lsb, LZW_LITERAL_WIDTH),
            input: Vec::new(),
            input_pos: 0,
            out: Vec::new(),
            out_pos: 0,
            input_done: false,
            finished: false,
        }
    }
}

impl<R: Read> Read for LzwReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if !self.pending().is_empty() {
                let pending = self.pending();
                let n = buf.len().min(pending.len());
                buf[..n].copy_from_slice(&pending[..n]);
                self.out_pos += n;
                return Ok(n);
            }
            if self.finished {
                return Ok(0);
            }
            if self.input_pos == self.input.len() && !self.input_done {
                self.input.resize(64 << 10, 0);
                let n = self.inner.read(&mut self.input)?;
                self.input.truncate(n);
                self.input_pos = 0;
                if n == 0 {
                    self.input_done = true;
                }
            }
            self.out.resize(256 << 10, 0);
            let res = self
                .decoder
                .decode_bytes(&self.input[self.input_pos..], &mut self.out);
            self.input_pos += res.consumed_in;
            self.out.truncate(res.consumed_out);
            self.out_pos = 0;
            match res.status {
                Ok(weezl::LzwStatus::Done) => self.finished = true,
                Ok(weezl::LzwStatus::Ok) => {}
                Ok(weezl::LzwStatus::NoProgress) => {
                    if self.input_done {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "lzw stream ends without its end code",
                        ));
                    }
                }
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            }
        }
    }
}

impl<R> LzwReader<R> {
    fn pending(&self) -> &[u8] {
        &self.out[self.out_pos.min(self.out.len())..]
    }
}

/// Passes `input` on until more than `limit` bytes have passed, then ends it with the error
/// `exceeded` makes (the chunk that crossed the limit is not passed on). Dropping the stream
/// there stops a decoder upstream, so a decompression bomb costs at most `limit` bytes.
pub fn bounded<F>(input: ByteStream, limit: u64, exceeded: F) -> ByteStream
where
    F: Fn() -> io::Error + Send + 'static,
{
    input
        .scan(Some(0u64), move |passed, item| {
            let Some(total) = passed.as_mut() else {
                return futures::future::ready(None);
            };
            let item = match item {
                Ok(chunk) => {
                    *total = total.saturating_add(chunk.len() as u64);
                    match *total > limit {
                        true => Err(exceeded()),
                        false => Ok(chunk),
                    }
                }
                Err(e) => Err(e),
            };
            if item.is_err() {
                *passed = None;
            }
            futures::future::ready(Some(item))
        })
        .boxed()
}

/// Collects a byte stream (tests and small payloads such as deltas).
pub async fn collect(mut s: ByteStream) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(b) = s.next().await {
        out.extend_from_slice(&b?);
    }
    Ok(out)
}

/// A stream of one chunk.
pub fn once(b: impl Into<Bytes>) -> ByteStream {
    futures::stream::once(futures::future::ready(Ok(b.into()))).boxed()
}

/// `data` as a stream of `size`-byte chunks (tests: a chunk boundary anywhere).
#[cfg(test)]
pub fn chunked(data: &[u8], size: usize) -> ByteStream {
    let v: Vec<io::Result<Bytes>> = data
        .chunks(size)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    futures::stream::iter(v).boxed()
}

/// A stream from any stream of chunks.
pub fn boxed<S>(s: S) -> ByteStream
where
    S: Stream<Item = io::Result<Bytes>> + Send + 'static,
{
    s.boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Vec<u8> {
        // Compressible but not trivial: a bbolt page looks much like this.
        (0..len)
            .map(|i| ((i * 7919) % 251) as u8 ^ ((i / 4096) as u8))
            .collect()
    }

    /// A stream whose producer panics after `good` chunks (what a bug in a codec, or a poisoned
    /// state, does to a compression thread).
    fn panics_after(good: usize) -> ByteStream {
        let data = sample(64 * 1024);
        let mut n = 0;
        futures::stream::poll_fn(move |_| {
            n += 1;
            assert!(n <= good, "injected panic in the stream's producer");
            std::task::Poll::Ready(Some(Ok(Bytes::copy_from_slice(&data))))
        })
        .boxed()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_producer_is_a_stream_error_never_a_clean_end() {
        // Through the read-ahead task.
        let e = collect(prefetch(panics_after(3), 2)).await.unwrap_err();
        assert!(e.to_string().contains("without finishing"), "{e}");
        // Through every encoder (the panic happens in the task feeding the compressor).
        for codec in [Codec::Gzip, Codec::Zlib] {
            let out = collect(codec.encode(panics_after(3), 2, Level::FAST).unwrap()).await;
            assert!(out.is_err(), "{codec}: a truncated payload ended cleanly");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panic_in_the_compression_thread_is_a_stream_error() {
        struct Panics;
        impl Read for Panics {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                panic!("injected panic in the compression thread")
            }
        }
        let out = blocking_transform(chunked(&sample(1 << 20), 65536), |_| Box::new(Panics));
        let e = collect(out).await.unwrap_err();
        assert!(e.to_string().contains("without finishing"), "{e}");
        // A reader that stops half-way on its own is fine: that is its output.
        let half = blocking_transform(chunked(&sample(1 << 20), 65536), |r| Box::new(r.take(1000)));
        assert_eq!(collect(half).await.unwrap().len(), 1000);
    }

    #[test]
    fn suffixes_round_trip() {
        for c in ALL_CODECS {
            assert_eq!(Codec::from_suffix(c.suffix()), Some(c));
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<Codec>(&json).unwrap(), c);
        }
        assert_eq!(Codec::from_suffix(".bz2"), None);
        assert_eq!(serde_json::to_string(&Codec::Gzip).unwrap(), "\".gz\"");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writable_codecs_round_trip_across_block_boundaries() {
        let data = sample(3 * BLOCK + 12345);
        for c in [Codec::None, Codec::Gzip, Codec::Zlib] {
            let enc = collect(c.encode(chunked(&data, 100_000), 3, Level::FAST).unwrap())
                .await
                .unwrap();
            if c != Codec::None {
                assert!(enc.len() < data.len(), "{c} did not compress");
            }
            let dec = collect(c.decode(chunked(&enc, 7777))).await.unwrap();
            assert_eq!(dec.len(), data.len(), "{c}");
            assert!(dec == data, "{c} round trip differs");
        }
    }

    /// Every level round-trips through both codecs, and a higher level never stores more of a
    /// compressible payload.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_level_round_trips_and_higher_levels_store_less() {
        let data: Vec<u8> = (0..3 * BLOCK / 2)
            .map(|i| b"etcd-warden/registry/"[i % 21] ^ ((i / 997) as u8 & 3))
            .collect();
        for codec in [Codec::Gzip, Codec::Zlib] {
            let mut sizes = Vec::new();
            for n in [1, 6, 9] {
                let level = Level::new(n).unwrap();
                let enc = collect(codec.encode(chunked(&data, 65536), 2, level).unwrap())
                    .await
                    .unwrap();
                let dec = collect(codec.decode(chunked(&enc, 4096))).await.unwrap();
                assert!(dec == data, "{codec} level {n}: round trip differs");
                sizes.push(enc.len());
            }
            assert!(
                sizes[0] >= sizes[1] && sizes[1] >= sizes[2],
                "{codec}: {sizes:?}"
            );
            assert!(
                sizes[0] > sizes[2],
                "{codec}: level 9 no smaller than 1: {sizes:?}"
            );
        }
        assert_eq!((Level::new(0), Level::new(10)), (None, None));
        assert_eq!(Level::default(), Level::FAST);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parallel_gzip_is_one_valid_multi_member_gzip_file() {
        let data = sample(2 * BLOCK + 1);
        let enc = collect(
            Codec::Gzip
                .encode(chunked(&data, 65536), 2, Level::FAST)
                .unwrap(),
        )
        .await
        .unwrap();
        // Each member starts with the gzip magic; there is one per block.
        let members = enc.windows(3).filter(|w| w == &[0x1f, 0x8b, 8]).count();
        assert!(members >= 3, "{members} members");
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&enc[..])
            .read_to_end(&mut out)
            .unwrap();
        assert!(out == data);
    }

    async fn gzip(data: &[u8]) -> Vec<u8> {
        collect(
            Codec::Gzip
                .encode(chunked(data, 65536), 2, Level::FAST)
                .unwrap(),
        )
        .await
        .unwrap()
    }

    fn gunzip_with_gnu_gzip(file: &[u8]) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.gz");
        std::fs::write(&path, file).unwrap();
        let out = std::process::Command::new("gzip")
            .arg("-dc")
            .arg(&path)
            .output()
            .expect("GNU gzip on PATH");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// Every size around a block's round-trips through the parallel inflate, whatever the input's
    /// chunking and the parallelism, and what etcd-warden writes is read by GNU gzip and
    /// flate2 alike.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sized_members_round_trip_in_parallel_and_stay_plain_gzip() {
        for len in [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 4321] {
            let data = sample(len);
            let enc = gzip(&data).await;
            assert!(
                matches!(gzip_members::head(&enc), Head::Sized { .. }),
                "{len}: the first member states no sizes"
            );
            for (chunk, parallelism) in [(7777, 1), (1 << 20, 2), (3 << 20, 3), (100, 4)] {
                if chunk == 100 && len > BLOCK + 1 {
                    continue;
                }
                let dec = collect(gzip_decode(chunked(&enc, chunk), parallelism))
                    .await
                    .unwrap();
                assert!(dec == data, "{len} in chunks of {chunk} on {parallelism}");
            }
            assert!(
                collect(Codec::Gzip.decode(chunked(&enc, 65536)))
                    .await
                    .unwrap()
                    == data
            );
            let mut out = Vec::new();
            flate2::read::MultiGzDecoder::new(&enc[..])
                .read_to_end(&mut out)
                .unwrap();
            assert!(out == data, "{len}: flate2");
            assert!(gunzip_with_gnu_gzip(&enc) == data, "{len}: GNU gzip");
        }
    }

    /// Gzip without sizes decodes as one stream, as before: flate2's single member (what
    /// etcd-backup-restore writes), GNU gzip's, and sized members followed by a plain one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gzip_without_sizes_still_decodes() {
        let data = sample(3 * BLOCK + 99);
        let mut single = Vec::new();
        let mut e = flate2::write::GzEncoder::new(&mut single, flate2::Compression::new(6));
        e.write_all(&data).unwrap();
        e.finish().unwrap();
        assert_eq!(gzip_members::head(&single), Head::Unsized);
        let dec = collect(Codec::Gzip.decode(chunked(&single, 65536)))
            .await
            .unwrap();
        assert!(dec == data, "flate2's single member");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plain");
        std::fs::write(&path, &data).unwrap();
        let out = std::process::Command::new("gzip")
            .arg("-1c")
            .arg(&path)
            .output()
            .expect("GNU gzip on PATH");
        assert!(out.status.success());
        let dec = collect(Codec::Gzip.decode(chunked(&out.stdout, 10_000)))
            .await
            .unwrap();
        assert!(dec == data, "gzip -1");
        // Sized members, then a plain member: the rest is decoded as one stream, after them.
        let mut mixed = gzip(&data[..2 * BLOCK + 5]).await;
        let rest_at = mixed.len();
        let mut e = flate2::write::GzEncoder::new(&mut mixed, flate2::Compression::fast());
        e.write_all(&data[2 * BLOCK + 5..]).unwrap();
        e.finish().unwrap();
        let mixed_len = mixed.len();
        mixed.extend(gzip(b"and sized again").await);
        let mut expect = data.clone();
        expect.extend_from_slice(b"and sized again");
        let dec = collect(gzip_decode(chunked(&mixed, 5000), 2))
            .await
            .unwrap();
        assert!(dec == expect, "sized, plain, sized");
        // The rest's errors name where it starts.
        let mut bad = mixed.clone();
        bad.truncate(mixed_len - 3);
        let e = collect(gzip_decode(chunked(&bad, 5000), 2))
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains(&format!("from offset {rest_at}")),
            "{e}"
        );
    }

    /// `Codec::decode` takes the parallel path for sized members from [`PARALLEL_FROM`] cores.
    #[test]
    fn sized_gzip_is_inflated_in_parallel_from_three_cores() {
        assert_eq!(inflaters(1), None);
        assert_eq!(inflaters(2), None);
        assert_eq!(inflaters(3), Some(3));
        assert_eq!(inflaters(16), Some(16));
    }

    /// A file whose members lie about themselves, each lie one the sequential decoder could not
    /// see or would see later: every one is an error naming the member's offset, never a panic
    /// or a clean end, in the parallel path. The first case, which flate2 reads without
    /// complaint, shows the parallel path is what ran.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lies_in_sized_members_are_errors_naming_the_member() {
        let data = sample(3 * BLOCK);
        let good = gzip(&data).await;
        let Head::Sized { sizes, .. } = gzip_members::head(&good) else {
            panic!("no sizes");
        };
        let second = sizes.stored as usize;
        let Head::Sized { sizes: s2, .. } = gzip_members::head(&good[second..]) else {
            panic!("no sizes in the second member");
        };
        let set = |f: &mut Vec<u8>, at: usize, v: u32| {
            f[at..at + 4].copy_from_slice(&v.to_le_bytes());
        };
        let decode = |f: Vec<u8>| async move {
            let out = collect(gzip_decode(chunked(&f, 65536), PARALLEL_FROM)).await;
            out.map(|v| v.len()).unwrap_err().to_string()
        };
        // The second member states one byte more inflated: flate2 does not read the field.
        let mut f = good.clone();
        set(&mut f, second + 20, s2.inflated + 1);
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&f[..])
            .read_to_end(&mut out)
            .unwrap();
        assert!(out == data);
        let e = decode(f).await;
        assert!(e.contains(&format!("offset {second}")), "{e}");
        // Stated stored size too small: the member is cut before its deflate stream ends.
        let mut f = good.clone();
        set(&mut f, second + 16, s2.stored - 100);
        let e = decode(f).await;
        assert!(
            e.contains(&format!("gzip member at offset {second}: its deflate")),
            "{e}"
        );
        // Too large: it runs into the next member.
        let mut f = good.clone();
        set(&mut f, second + 16, s2.stored + 100);
        let e = decode(f).await;
        assert!(
            e.contains(&format!("offset {second}")) && e.contains("end after"),
            "{e}"
        );
        // Past the end of the input.
        let mut f = good.clone();
        let last = second + s2.stored as usize;
        set(&mut f, last + 16, (good.len() - last) as u32 + 10);
        let e = decode(f).await;
        assert!(
            e.contains(&format!("offset {last}")) && e.contains("input ends"),
            "{e}"
        );
        // A corrupted CRC in the trailer.
        let mut f = good.clone();
        f[second + s2.stored as usize - 6] ^= 0x40;
        let e = decode(f).await;
        assert!(
            e.contains("CRC-32") && e.contains(&format!("offset {second}")),
            "{e}"
        );
        // Truncated: mid-member, and mid-header.
        let e = decode(good[..good.len() - 1].to_vec()).await;
        assert!(e.contains("input ends"), "{e}");
        let e = decode(good[..last + 7].to_vec()).await;
        assert!(
            e.contains(&format!("offset {last}")) && e.contains("into its header"),
            "{e}"
        );
        // 4 GiB inflated claimed, in the first member: refused before any allocation.
        let mut f = good.clone();
        set(&mut f, 20, u32::MAX);
        let e = decode(f).await;
        assert!(e.contains("offset 0") && e.contains("4294967295"), "{e}");
        // Garbage after the members.
        let mut f = good.clone();
        f.extend_from_slice(b"trailing");
        let e = decode(f).await;
        assert!(e.contains(&format!("offset {}", good.len())), "{e}");
        // Nothing of the members after an error passes: the stream ends at it.
        let mut f = good.clone();
        f[40] ^= 0xff;
        let mut s = gzip_decode(chunked(&f, 65536), PARALLEL_FROM);
        assert!(s.next().await.unwrap().is_err());
        assert!(s.next().await.is_none());
    }

    /// Input shorter than a header, from a stream that must not be polled after its end (as
    /// `unfold`'s): decoded as one stream, as before, never polled again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_short_input_ends_without_polling_its_source_again() {
        for bytes in [&b""[..], b"\x1f", b"\x1f\x8b\x08\x04\0\0\0\0\0\xff\x0c"] {
            let source = futures::stream::unfold(false, move |sent| async move {
                (!sent).then(|| (Ok(Bytes::copy_from_slice(bytes)), true))
            })
            .boxed();
            // Each is flate2's error (no gzip header), not a panicked reader's.
            let e = collect(Codec::Gzip.decode(source)).await.unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{bytes:?}: {e}");
        }
    }

    /// A producer that dies after some sized members is an error of the decoded stream.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_producer_under_the_parallel_inflate_is_an_error() {
        let enc = gzip(&sample(4 * BLOCK)).await;
        let cut = enc.len() / 2;
        let mut n = 0;
        let pieces: Vec<Bytes> = enc[..cut]
            .chunks(65536)
            .map(Bytes::copy_from_slice)
            .collect();
        let dying = futures::stream::poll_fn(move |_| {
            n += 1;
            assert!(n <= pieces.len(), "injected panic in the stream's producer");
            std::task::Poll::Ready(Some(Ok(pieces[n - 1].clone())))
        })
        .boxed();
        let out = collect(Codec::Gzip.decode(prefetch(dying, 2))).await;
        assert!(out.is_err(), "a dead producer ended cleanly");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lzw_reads_go_lsb_width_8() {
        // Go's lzw.NewWriter(w, lzw.LSB, 8) of "TOBEORNOTTOBEORTOBEORNOT" (hand-checked codes:
        // clear 256 is emitted first, end 257 last, 9-bit codes packed LSB first).
        let text = b"TOBEORNOTTOBEORTOBEORNOT";
        let mut enc = weezl::encode::Encoder::new(weezl::BitOrder::Lsb, 8);
        let packed = enc.encode(text).unwrap();
        // First code is clear (256 = 0b1_0000_0000): low byte 0x00, then bit 0 of byte 1 set.
        assert_eq!(packed[0], 0x00);
        assert_eq!(packed[1] & 1, 1);
        let dec = collect(Codec::Lzw.decode(chunked(&packed, 3)))
            .await
            .unwrap();
        assert_eq!(dec, text);
        let big = sample(300_000);
        let packed = weezl::encode::Encoder::new(weezl::BitOrder::Lsb, 8)
            .encode(&big)
            .unwrap();
        let dec = collect(Codec::Lzw.decode(chunked(&packed, 4096)))
            .await
            .unwrap();
        assert!(dec == big);
        assert!(Codec::Lzw.encode(chunked(text, 4), 1, Level::FAST).is_err());
    }

    /// Packs codes LSB first, `width` bits each, as Go's `lzw.NewWriter(w, lzw.LSB, 8)` does
    /// below 512 codes.
    fn pack9(codes: &[u16]) -> Vec<u8> {
        let (mut out, mut acc, mut bits) = (Vec::new(), 0u32, 0);
        for &c in codes {
            acc |= u32::from(c) << bits;
            bits += 9;
            while bits >= 8 {
                out.push(acc as u8);
                acc >>= 8;
                bits -= 8;
            }
        }
        if bits > 0 {
            out.push(acc as u8);
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lzw_reads_hand_built_go_streams() {
        // "ABABABA": A, B, then table entries 258 = "AB" and 260 = "ABA", then end (257).
        // Current Go writes a clear code (256) first; older writers did not: both are read.
        let with_clear = pack9(&[256, 65, 66, 258, 260, 257]);
        let without = pack9(&[65, 66, 258, 260, 257]);
        for packed in [with_clear, without] {
            let dec = collect(Codec::Lzw.decode(chunked(&packed, 1)))
                .await
                .unwrap();
            assert_eq!(dec, b"ABABABA");
        }
        // A stream cut before its end code is an error, as for Go's reader.
        let cut = pack9(&[256, 65, 66, 258]);
        assert!(collect(Codec::Lzw.decode(chunked(&cut, 2))).await.is_err());
    }

    /// A bounded decode stops at its limit with the caller's error and passes nothing beyond
    /// it; a payload within the limit passes whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bounded_decode_stops_at_its_limit() {
        let zeros = vec![0u8; 8 << 20];
        let bomb = collect(
            Codec::Gzip
                .encode(chunked(&zeros, 1 << 20), 2, Level::FAST)
                .unwrap(),
        )
        .await
        .unwrap();
        let too_much = || io::Error::new(io::ErrorKind::InvalidData, "too much");
        let mut out = bounded(Codec::Gzip.decode(chunked(&bomb, 4096)), 1 << 20, too_much);
        let mut passed = 0;
        let e = loop {
            match out.next().await {
                Some(Ok(b)) => passed += b.len(),
                Some(Err(e)) => break e,
                None => panic!("a payload over the limit ended cleanly"),
            }
        };
        assert_eq!(e.to_string(), "too much");
        assert!(passed <= 1 << 20, "{passed} bytes passed");
        assert!(out.next().await.is_none(), "nothing after the error");
        let whole = bounded(Codec::Gzip.decode(chunked(&bomb, 4096)), 8 << 20, too_much);
        assert_eq!(collect(whole).await.unwrap().len(), 8 << 20);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn corrupt_input_is_an_error() {
        let data = sample(100_000);
        let mut enc = collect(
            Codec::Gzip
                .encode(chunked(&data, 4096), 1, Level::FAST)
                .unwrap(),
        )
        .await
        .unwrap();
        let mid = enc.len() / 2;
        enc[mid] ^= 0xff;
        assert!(
            collect(Codec::Gzip.decode(chunked(&enc, 4096)))
                .await
                .is_err()
        );
        let good = collect(
            Codec::Zlib
                .encode(chunked(&data, 4096), 1, Level::FAST)
                .unwrap(),
        )
        .await
        .unwrap();
        let truncated = &good[..good.len() / 2];
        assert!(
            collect(Codec::Zlib.decode(chunked(truncated, 4096)))
                .await
                .is_err()
        );
    }
}
