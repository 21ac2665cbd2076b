//! Client-side encryption of snapshot payloads: each payload is an age file (X25519 recipients,
//! the STREAM payload: 64 KiB chunks, each authenticated, the last one marked as last), written
//! after compression, so the standard `age` tool decrypts it and a truncated or altered object
//! fails to decrypt instead of restoring something else.
//!
//! Writing needs only public keys: a sidecar that is compromised cannot read the backups it
//! (or anyone else) wrote. Reading needs an identity (a private key file).

use std::io::{self, BufRead, BufWriter, Read, Write};

use super::compression::{ByteStream, blocking_pipe, blocking_transform};
use crate::config::KeyError;

/// Why a snapshot cannot be encrypted or decrypted; each names the snapshot.
#[derive(Debug, thiserror::Error)]
pub enum EncryptionError {
    /// A key file could not be read, so the snapshot is neither written nor read (it is never
    /// written in clear instead).
    #[error("{snapshot}: {source}")]
    Key {
        /// The snapshot's name.
        snapshot: String,
        #[source]
        source: KeyError,
    },
    /// The snapshot is encrypted and no identity is configured to read it.
    #[error(
        "{snapshot} is encrypted and no identity is configured to decrypt it: set \
         encryption.identities (ETCD_WARDEN_ENCRYPTION_IDENTITIES) to a private key file of one \
         of its recipients"
    )]
    NoIdentity {
        /// The snapshot's name.
        snapshot: String,
    },
    /// No configured identity opens the snapshot's header, or the header is damaged.
    #[error("{snapshot} cannot be decrypted with the identities in {files}: {reason}")]
    Undecryptable {
        /// The snapshot's name.
        snapshot: String,
        /// The identity files tried.
        files: String,
        /// Why: the header bound it crosses ([`HeaderError`]), or age's reason.
        reason: String,
    },
    /// The store encrypts but no recipient is left (every recipients file is empty).
    #[error("{snapshot}: encryption is configured but no recipient is (encryption.recipients)")]
    NoRecipient {
        /// The snapshot's name.
        snapshot: String,
    },
}

/// How every age file begins (the version line of its header).
pub const AGE_MAGIC: &[u8] = b"age-encryption.org/v1\n";
/// The most stanzas an age header may hold. age and rage write one per recipient plus one
/// "grease" stanza; a store's recipients are a handful of keys, so 256 is far above any file
/// etcd-warden or the `age` tool writes for it.
pub const MAX_STANZAS: usize = 256;
/// The longest line of an age header, its newline included. Stanza bodies are wrapped at 64
/// columns; the longest argument line age writes (a post-quantum `mlkem768x25519` share) is
/// about 1.5 KiB.
pub const MAX_HEADER_LINE: usize = 4 << 10;
/// The longest age header: 256 X25519 stanzas take about 26 KiB.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// The payload nonce that follows the header.
const NONCE_LEN: usize = 16;
/// Bytes of an object enough to hold the longest header [`read_header`] accepts and the payload
/// nonce: what [`check_header`] needs.
pub const HEADER_PROBE: usize = MAX_HEADER_BYTES + NONCE_LEN;
/// How a header's MAC line begins (it ends the header).
const MAC_LINE: &[u8] = b"---";
/// The MAC's length in (unpadded) base64.
const MAC_CHARS: usize = 43;
/// How a stanza's first line begins.
const STANZA_LINE: &[u8] = b"-> ";

/// Why an object's age header is refused or does not open: the object is not decrypted.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// The first line is not age's v1 version line.
    #[error("it is not a valid age file (its first line is not \"age-encryption.org/v1\")")]
    NotAge,
    /// The line beginning with `---` (the header's end) is not `--- ` and a base64 MAC.
    #[error("line {line} of its age header is not a MAC line (\"--- \" and 43 base64 characters)")]
    MacLine {
        /// The line's number, from 1.
        line: usize,
    },
    /// The object ends before the header's MAC line.
    #[error("its age header is truncated (it ends before the \"---\" MAC line)")]
    Truncated,
    /// A header line is longer than [`MAX_HEADER_LINE`].
    #[error("line {line} of its age header is longer than {MAX_HEADER_LINE} bytes")]
    LineTooLong {
        /// The line's number, from 1.
        line: usize,
    },
    /// The header has more than [`MAX_STANZAS`] stanzas.
    #[error("its age header has more than {MAX_STANZAS} stanzas (age writes one per recipient)")]
    TooManyStanzas,
    /// The header is longer than [`MAX_HEADER_BYTES`].
    #[error("its age header is longer than {MAX_HEADER_BYTES} bytes")]
    TooLong,
    /// Reading the object failed (the store, not the header).
    #[error("reading its age header: {0}")]
    Read(#[source] io::Error),
    /// None of the identities opens the header.
    #[error("it is encrypted to other keys")]
    OtherKeys,
    /// age refused the header (a damaged stanza, a wrong MAC, a truncated nonce).
    #[error("its header is damaged ({0})")]
    Damaged(age::DecryptError),
}

/// The buffer between the encryptor and the output channel: one output chunk.
const OUT_CHUNK: usize = 256 << 10;
/// Chunks queued on each side of the encrypting thread.
const DEPTH: usize = 2;

/// Encrypts `input` to every recipient on a blocking thread. Memory stays flat: one STREAM chunk,
/// one output buffer and a few queued chunks, whatever the payload's size.
pub fn encrypt(input: ByteStream, recipients: Vec<age::x25519::Recipient>) -> ByteStream {
    blocking_pipe(input, DEPTH, move |plain, out| {
        let mut sealed =
            encryptor(&recipients)?.wrap_output(BufWriter::with_capacity(OUT_CHUNK, out))?;
        copy_large(plain, &mut sealed)?;
        sealed.finish()?.flush()
    })
}

/// Encrypts a small payload in memory, as [`encrypt`] would stream it.
pub fn encrypt_bytes(plain: &[u8], recipients: &[age::x25519::Recipient]) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(plain.len() + 1024);
    let mut sealed = encryptor(recipients)?.wrap_output(&mut out)?;
    sealed.write_all(plain)?;
    sealed.finish()?;
    Ok(out)
}

fn encryptor(recipients: &[age::x25519::Recipient]) -> io::Result<age::Encryptor> {
    age::Encryptor::with_recipients(recipients.iter().map(|r| r as &dyn age::Recipient))
        .map_err(|e| io::Error::other(format!("cannot encrypt: {e}")))
}

/// Decrypts an age file with the first identity that unwraps it, on a blocking thread. A header
/// no identity opens, one beyond the bounds of [`read_header`], a chunk that fails its
/// authentication, or a file that ends before its last chunk ends the stream with an
/// `InvalidData` error.
pub fn decrypt(input: ByteStream, identities: Vec<age::x25519::Identity>) -> ByteStream {
    blocking_transform(input, move |encrypted| {
        match open(
            io::BufReader::with_capacity(64 << 10, encrypted),
            &identities,
        ) {
            Ok(reader) => Box::new(AuthReader(reader)),
            Err(e) => Box::new(Failed(Some(e.into_io()))),
        }
    })
}

/// Whether the first identity that matches opens the header in `head` (an object's first bytes,
/// at least its header and nonce: [`HEADER_PROBE`] holds any header accepted): the check that
/// fails before anything is restored.
pub fn check_header(head: &[u8], identities: &[age::x25519::Identity]) -> Result<(), HeaderError> {
    open(head, identities).map(drop)
}

/// The decrypting reader of the age file `input`: its header read and bounded first, then
/// handed to age with the rest.
fn open<R: BufRead>(
    mut input: R,
    identities: &[age::x25519::Identity],
) -> Result<age::stream::StreamReader<Checked<R>>, HeaderError> {
    let header = read_header(&mut input)?;
    let checked = Checked::new(header, input);
    age::Decryptor::new_buffered(checked)
        .and_then(|d| d.decrypt(identities.iter().map(|i| i as &dyn age::Identity)))
        .map_err(HeaderError::from_age)
}

/// Reads an age header up to and including its MAC line, within [`MAX_HEADER_LINE`],
/// [`MAX_STANZAS`] and [`MAX_HEADER_BYTES`]: never more than a line's bound of a line is
/// buffered, and a header beyond a bound is refused where it crosses it. Only the shape age
/// needs to find the header's end is checked here; age parses the stanzas.
pub fn read_header<R: BufRead>(input: &mut R) -> Result<Vec<u8>, HeaderError> {
    let mut header = Vec::with_capacity(1024);
    let mut stanzas = 0;
    for line in 1.. {
        let start = header.len();
        let room = MAX_HEADER_BYTES - start;
        let cap = MAX_HEADER_LINE.min(room);
        // `take` keeps a line without a newline (a 400 MB one) from being buffered whole.
        let n = input
            .by_ref()
            .take(cap as u64)
            .read_until(b'\n', &mut header)
            .map_err(HeaderError::Read)?;
        let text = &header[start..];
        if text.last() != Some(&b'\n') {
            return Err(match () {
                _ if line == 1 => HeaderError::NotAge,
                _ if n < cap => HeaderError::Truncated,
                _ if cap == room => HeaderError::TooLong,
                _ => HeaderError::LineTooLong { line },
            });
        }
        if line == 1 {
            if text != AGE_MAGIC {
                return Err(HeaderError::NotAge);
            }
        } else if text.starts_with(MAC_LINE) {
            // Exactly what age's parser takes, so that it never asks for bytes past the header.
            let mac = &text[MAC_LINE.len()..];
            let well_formed = mac.len() == 1 + MAC_CHARS + 1
                && mac[0] == b' '
                && mac[1..=MAC_CHARS].iter().all(|&b| is_base64(b))
                && mac[MAC_CHARS + 1] == b'\n';
            return match well_formed {
                true => Ok(header),
                false => Err(HeaderError::MacLine { line }),
            };
        } else if text.starts_with(STANZA_LINE) {
            stanzas += 1;
            if stanzas > MAX_STANZAS {
                return Err(HeaderError::TooManyStanzas);
            }
        }
    }
    unreachable!("the loop over lines returns")
}

fn is_base64(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'+' || b == b'/'
}

impl HeaderError {
    fn from_age(e: age::DecryptError) -> HeaderError {
        match e {
            age::DecryptError::Io(e) if e.kind() != io::ErrorKind::InvalidData => {
                match e.kind() {
                    // The nonce cut short: the object ends there.
                    io::ErrorKind::UnexpectedEof => HeaderError::Truncated,
                    _ => HeaderError::Read(e),
                }
            }
            age::DecryptError::NoMatchingKeys => HeaderError::OtherKeys,
            other => HeaderError::Damaged(other),
        }
    }

    /// As the stream reports it: invalid data, with the reason; a read failure as it is.
    fn into_io(self) -> io::Error {
        match self {
            HeaderError::Read(e) => e,
            HeaderError::OtherKeys => io::Error::new(
                io::ErrorKind::InvalidData,
                "no configured identity can decrypt it (encrypted to other keys)",
            ),
            HeaderError::Damaged(e) => io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not a valid age file: {e}"),
            ),
            other => io::Error::new(io::ErrorKind::InvalidData, other),
        }
    }
}

/// An age file whose header [`read_header`] has read, given back to age ahead of the rest.
///
/// age's buffered header parser reads one line at a time and parses the whole header again
/// after each (quadratic in the header's lines: 60 KB of one-line stanzas took 16 s). Asked for
/// a line of a header that is already complete and checked, this hands over all of it at once,
/// so age parses it once. The header read ends with its MAC line's newline, so what is handed
/// over still ends at the delimiter asked for.
struct Checked<R> {
    header: Vec<u8>,
    /// How much of `header` age has taken.
    pos: usize,
    rest: R,
    /// Times age asked for header bytes or a line (each a parse of the header so far).
    header_reads: usize,
}

impl<R> Checked<R> {
    fn new(header: Vec<u8>, rest: R) -> Self {
        Checked {
            header,
            pos: 0,
            rest,
            header_reads: 0,
        }
    }

    fn in_header(&self) -> bool {
        self.pos < self.header.len()
    }
}

impl<R: BufRead> Read for Checked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.in_header() {
            return self.rest.read(buf);
        }
        let n = self.fill_buf()?.len().min(buf.len());
        buf[..n].copy_from_slice(&self.header[self.pos..self.pos + n]);
        self.consume(n);
        Ok(n)
    }
}

impl<R: BufRead> BufRead for Checked<R> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.in_header() {
            self.header_reads += 1;
            return Ok(&self.header[self.pos..]);
        }
        self.rest.fill_buf()
    }

    fn consume(&mut self, amt: usize) {
        if self.in_header() {
            self.pos = (self.pos + amt).min(self.header.len());
        } else {
            self.rest.consume(amt);
        }
    }

    fn read_until(&mut self, byte: u8, buf: &mut Vec<u8>) -> io::Result<usize> {
        self.header_reads += 1;
        if !self.in_header() {
            // Only age's header parser reads lines, and the header it was handed is complete:
            // should it ask for more, a line of the rest is bounded as a header line is.
            return self
                .rest
                .by_ref()
                .take(MAX_HEADER_LINE as u64)
                .read_until(byte, buf);
        }
        let left = &self.header[self.pos..];
        let take = match byte {
            // The header ends with a newline: all of it ends at one.
            b'\n' => left.len(),
            _ => match left.iter().position(|&b| b == byte) {
                Some(i) => i + 1,
                None => {
                    let n = left.len();
                    buf.extend_from_slice(left);
                    self.pos = self.header.len();
                    return Ok(n + self.read_until(byte, buf)?);
                }
            },
        };
        buf.extend_from_slice(&left[..take]);
        self.pos += take;
        Ok(take)
    }
}

/// How often age asked for header bytes while opening `data` with `identities` (tests and the
/// fuzz target: once for a header read ahead, however many lines it has), or why it failed.
#[doc(hidden)]
pub fn header_reads(
    data: &[u8],
    identities: &[age::x25519::Identity],
) -> Result<usize, (usize, HeaderError)> {
    let mut input = data;
    let header = read_header(&mut input).map_err(|e| (0, e))?;
    let mut checked = Checked::new(header, input);
    let opened = age::Decryptor::new_buffered(&mut checked)
        .and_then(|d| d.decrypt(identities.iter().map(|i| i as &dyn age::Identity)))
        .map(drop);
    match opened {
        Ok(()) => Ok(checked.header_reads),
        Err(e) => Err((checked.header_reads, HeaderError::from_age(e))),
    }
}

/// Whether a payload starts as an age file does (what the copy job checks without a key).
pub fn looks_encrypted(head: &[u8]) -> bool {
    head.starts_with(AGE_MAGIC)
}

/// The STREAM reader's errors marked as what they are: a payload that failed authentication.
struct AuthReader<R>(R);

impl<R: Read> Read for AuthReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf).map_err(|e| {
            if e.kind() == io::ErrorKind::InvalidData || e.kind() == io::ErrorKind::UnexpectedEof {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "the encrypted payload failed authentication (truncated or altered): {e}"
                    ),
                )
            } else {
                e
            }
        })
    }
}

/// A reader that fails once with the error it holds.
struct Failed(Option<io::Error>);

impl Read for Failed {
    fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
        Err(self
            .0
            .take()
            .unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "decryption failed")))
    }
}

/// `io::copy` with a buffer of the STREAM chunk size, so each write seals a whole chunk.
fn copy_large(from: &mut dyn Read, to: &mut dyn Write) -> io::Result<u64> {
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        to.write_all(&buf[..n])?;
        total += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::compression::{chunked, collect};
    use bytes::Bytes;
    use futures::StreamExt;

    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[tokio::test]
    async fn round_trips_with_either_of_two_recipients_and_not_a_third() {
        let (a, b, c) = (
            age::x25519::Identity::generate(),
            age::x25519::Identity::generate(),
            age::x25519::Identity::generate(),
        );
        // Sizes around the 64 KiB STREAM chunk and the output buffer.
        for len in [0, 1, 65_535, 65_536, 65_537, 300_000, 1 << 20] {
            let plain = payload(len);
            let sealed = collect(encrypt(
                chunked(&plain, 10_000),
                vec![a.to_public(), b.to_public()],
            ))
            .await
            .unwrap();
            assert!(looks_encrypted(&sealed), "{len}");
            assert!(
                check_header(
                    &sealed[..sealed.len().min(HEADER_PROBE)],
                    std::slice::from_ref(&b)
                )
                .is_ok()
            );
            for id in [&a, &b] {
                let back = collect(decrypt(chunked(&sealed, 7_000), vec![id.clone()]))
                    .await
                    .unwrap();
                assert_eq!(back.len(), plain.len(), "{len}");
                assert!(back[..] == plain[..], "{len}");
            }
            let e = collect(decrypt(chunked(&sealed, 7_000), vec![c.clone()]))
                .await
                .unwrap_err();
            assert!(e.to_string().contains("no configured identity"), "{e}");
            assert!(matches!(
                check_header(&sealed, std::slice::from_ref(&c)),
                Err(HeaderError::OtherKeys)
            ));
        }
    }

    #[tokio::test]
    async fn every_flipped_byte_and_every_truncation_fails() {
        let id = age::x25519::Identity::generate();
        let plain = payload(150_000);
        let sealed = encrypt_bytes(&plain, &[id.to_public()]).unwrap();
        let streamed = collect(encrypt(chunked(&plain, 4096), vec![id.to_public()]))
            .await
            .unwrap();
        // Each file has its own header (a random ephemeral key, and age's random "grease"
        // stanza), so only the payload's length is common.
        let id_back = collect(decrypt(chunked(&streamed, 9_000), vec![id.clone()]))
            .await
            .unwrap();
        assert!(id_back[..] == plain[..]);
        // Every byte of the header and nonce, and a spread over the payload's chunks and tags.
        let header_end = sealed.len() - (plain.len() + 3 * 16);
        let positions = (0..header_end).chain((header_end..sealed.len()).step_by(997));
        for at in positions.chain([sealed.len() - 1]) {
            let mut bad = sealed.clone();
            bad[at] ^= 0x20;
            let got = collect(decrypt(chunked(&bad, 50_000), vec![id.clone()])).await;
            assert!(
                got.is_err(),
                "flipping byte {at} of {} went unnoticed",
                sealed.len()
            );
        }
        for len in [
            0,
            10,
            header_end,
            header_end + 100,
            65_536 + header_end + 16,
            sealed.len() - 1,
        ] {
            let got = collect(decrypt(chunked(&sealed[..len], 50_000), vec![id.clone()])).await;
            assert!(got.is_err(), "truncation to {len} went unnoticed");
        }
    }

    /// An age file whose header is `age-encryption.org/v1`, `stanzas`, a well-formed MAC line,
    /// then a nonce and a payload chunk: the shape of the crafted headers.
    fn crafted(stanzas: &[u8]) -> Vec<u8> {
        let mut file = AGE_MAGIC.to_vec();
        file.extend_from_slice(stanzas);
        file.extend_from_slice(b"--- ");
        file.extend_from_slice(&[b'A'; MAC_CHARS]);
        file.push(b'\n');
        file.extend_from_slice(&[0u8; NONCE_LEN + 1000]);
        file
    }

    /// A stream of `data` in `size`-byte chunks, produced only as it is read, and how many bytes
    /// have been produced so far.
    fn counted(
        data: impl Fn(usize) -> u8 + Send + 'static,
        len: usize,
        size: usize,
    ) -> (ByteStream, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let produced = std::sync::Arc::new(AtomicUsize::new(0));
        let count = produced.clone();
        let stream = futures::stream::unfold(0usize, move |at| {
            let chunk = (at < len).then(|| {
                let end = (at + size).min(len);
                count.fetch_add(end - at, Ordering::SeqCst);
                (
                    Ok(Bytes::from((at..end).map(&data).collect::<Vec<u8>>())),
                    end,
                )
            });
            futures::future::ready(chunk)
        })
        .boxed();
        (stream, produced)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_quadratic_header_is_refused_at_its_stanza_bound_in_linear_work() {
        let id = age::x25519::Identity::generate();
        // 10,000 stanzas "-> a" with empty bodies (60 KB): age alone parsed the header again
        // per line, 16 s in a release build.
        let file = crafted(&b"-> a\n\n".repeat(10_000));
        let started = std::time::Instant::now();
        let e = check_header(&file, std::slice::from_ref(&id)).unwrap_err();
        assert!(matches!(e, HeaderError::TooManyStanzas), "{e}");
        let e = collect(decrypt(chunked(&file, 4096), vec![id.clone()]))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("more than 256 stanzas"), "{e}");
        // The work, counted: the header is read to its 257th stanza's line and no further.
        let mut rest = &file[..];
        assert!(read_header(&mut rest).is_err());
        assert_eq!(file.len() - rest.len(), AGE_MAGIC.len() + 256 * 6 + 5);
        // A generous wall-clock bound on top, for the two full reads above: microseconds now.
        assert!(started.elapsed() < std::time::Duration::from_secs(1));

        // Within the bounds, the worst shape for age's line-by-line parse: 256 stanzas, their
        // bodies 64-column lines up to the byte bound. age is handed the header once.
        let body = [&[b'A'; 64][..], b"\n"].concat().repeat(3);
        let stanza = [&b"-> a\n"[..], &body, b"\n"].concat();
        let mut stanzas = stanza.repeat(MAX_STANZAS);
        stanzas.truncate(MAX_HEADER_BYTES - AGE_MAGIC.len() - 100);
        let cut = stanzas.iter().rposition(|&b| b == b'\n').unwrap();
        stanzas.truncate(cut + 1);
        stanzas.extend_from_slice(b"\n");
        let file = crafted(&stanzas);
        let (reads, e) = header_reads(&file, std::slice::from_ref(&id)).unwrap_err();
        assert_eq!(reads, 1, "{e}");
        assert!(
            matches!(e, HeaderError::Damaged(_) | HeaderError::OtherKeys),
            "{e}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_400_mb_header_line_is_refused_without_buffering_it() {
        use std::sync::atomic::Ordering;
        let id = age::x25519::Identity::generate();
        let len = 400 << 20;
        // As the first line, a stanza's line and a body line.
        for prefix in [
            &b"age-encryption.org/v1"[..],
            b"age-encryption.org/v1\n-> ",
            b"age-encryption.org/v1\n-> X25519 a\n",
        ] {
            let prefix = prefix.to_vec();
            let (stream, produced) = counted(
                move |i| prefix.get(i).copied().unwrap_or(b'a'),
                len,
                64 << 10,
            );
            let e = collect(decrypt(stream, vec![id.clone()]))
                .await
                .unwrap_err();
            let e = e.to_string();
            assert!(
                e.contains("not a valid age file")
                    || e.contains("of its age header is longer than 4096"),
                "{e}"
            );
            // What was read: the reader's buffer and the chunks queued to it, not the line.
            let read = produced.load(Ordering::SeqCst);
            assert!(
                read <= 1 << 20,
                "{read} bytes of a {len}-byte line were read"
            );
        }
    }

    #[test]
    fn each_header_bound_refuses_where_it_is_crossed_and_not_before() {
        let id = age::x25519::Identity::generate();
        let opens = |file: &[u8]| check_header(file, std::slice::from_ref(&id));
        // The stanza bound: 256 pass on to age (which finds no key), 257 do not.
        let e = opens(&crafted(&b"-> a\n\n".repeat(MAX_STANZAS))).unwrap_err();
        assert!(
            matches!(e, HeaderError::Damaged(_) | HeaderError::OtherKeys),
            "{e}"
        );
        let e = opens(&crafted(&b"-> a\n\n".repeat(MAX_STANZAS + 1))).unwrap_err();
        assert!(matches!(e, HeaderError::TooManyStanzas), "{e}");
        // The line bound, its newline included.
        let line = |len: usize| [&b"-> "[..], &vec![b'a'; len - 4], b"\n\n"].concat();
        let e = opens(&crafted(&line(MAX_HEADER_LINE))).unwrap_err();
        assert!(
            matches!(e, HeaderError::Damaged(_) | HeaderError::OtherKeys),
            "{e}"
        );
        let e = opens(&crafted(&line(MAX_HEADER_LINE + 1))).unwrap_err();
        assert!(matches!(e, HeaderError::LineTooLong { line: 2 }), "{e}");
        // The byte bound: few stanzas of long bodies.
        let body = [&[b'A'; 64][..], b"\n"].concat().repeat(1100);
        let e = opens(&crafted(&[&b"-> a\n"[..], &body, b"\n"].concat())).unwrap_err();
        assert!(matches!(e, HeaderError::TooLong), "{e}");
        // The header's end: a MAC line age would have to read past, an object cut short.
        let good = encrypt_bytes(b"x", &[id.to_public()]).unwrap();
        let mac = good.windows(4).position(|w| w == b"\n---").unwrap() + 1;
        let mut bad = good.clone();
        bad[mac + 10] = b'\n';
        assert!(matches!(opens(&bad), Err(HeaderError::MacLine { .. })));
        for cut in [0, 5, AGE_MAGIC.len(), mac, mac + 20, mac + 48, mac + 50] {
            let e = opens(&good[..cut]).unwrap_err();
            assert!(
                matches!(
                    e,
                    HeaderError::NotAge | HeaderError::Truncated | HeaderError::MacLine { .. }
                ),
                "cut at {cut}: {e}"
            );
        }
        assert!(matches!(
            opens(b"age-encryption.org/v2\n"),
            Err(HeaderError::NotAge)
        ));
        // What this crate writes opens, with age handed its header once.
        assert_eq!(header_reads(&good, std::slice::from_ref(&id)).unwrap(), 1);
    }

    #[tokio::test]
    async fn an_input_error_is_never_sealed_as_a_complete_file() {
        let id = age::x25519::Identity::generate();
        let input = futures::stream::iter(vec![
            Ok(Bytes::from(payload(100_000))),
            Err(io::Error::other("etcd went away")),
        ])
        .boxed();
        let e = collect(encrypt(input, vec![id.to_public()]))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("etcd went away"), "{e}");
    }
}
