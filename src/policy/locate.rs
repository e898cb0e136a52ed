//! Finds the line of a key path (`routes[0].chain[1].backend`) in YAML source text.
//!
//! Validation works on parsed values, which have forgotten where they came from; an operator
//! still needs a line number. Rather than keep spans on every value, this walks the text by
//! indentation, following block mapping keys and `- ` list items. A flow collection
//! (`{...}` or `[...]`) on one line ends the walk at that line. It never fails: it returns the
//! deepest line it could follow the path to, so a missing key points at its parent.

/// One step of a key path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seg {
    Key(String),
    Index(usize),
}

/// Parses `a.b[2].c` into segments. Keys never contain `.` or `[` in a policy.
pub(crate) fn parse_path(p: &str) -> Vec<Seg> {
    let mut out = Vec::new();
    for part in p.split('.').filter(|s| !s.is_empty()) {
        let (key, mut rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            out.push(Seg::Key(key.to_owned()));
        }
        while let Some(inner) = rest.strip_prefix('[') {
            let Some(end) = inner.find(']') else { break };
            if let Ok(i) = inner[..end].parse() {
                out.push(Seg::Index(i));
            }
            rest = &inner[end + 1..];
        }
    }
    out
}

/// Renders segments back as `a.b[2].c`.
pub(crate) fn path_to_string(segs: &[Seg]) -> String {
    let mut s = String::new();
    for seg in segs {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

#[derive(Debug, Clone, Copy)]
struct Line<'a> {
    /// 1-based.
    no: usize,
    indent: usize,
    text: &'a str,
}

fn content_lines(src: &str) -> Vec<Line<'_>> {
    src.lines()
        .enumerate()
        .filter_map(|(i, raw)| {
            let text = raw.trim_start_matches(' ');
            let t = text.trim_end();
            if t.is_empty() || t.starts_with('#') || t == "---" || t == "..." {
                return None;
            }
            Some(Line {
                no: i + 1,
                indent: raw.len() - text.len(),
                text: t,
            })
        })
        .collect()
}

/// The line of `base` followed by `path` in `src`; the deepest line reached when the path
/// does not resolve all the way; line 1 when not even the first key is there.
pub(crate) fn locate(src: &str, base: &[Seg], path: &[Seg]) -> Option<usize> {
    let lines = content_lines(src);
    let first = lines.first()?;
    let mut best = first.no;
    let segs: Vec<&Seg> = base.iter().chain(path.iter()).collect();
    let mut region: Vec<Line<'_>> = lines.clone();
    for seg in segs {
        let Some(head) = region.first().copied() else {
            break;
        };
        let ind = head.indent;
        match seg {
            Seg::Key(k) => {
                let Some(pos) = region
                    .iter()
                    .position(|l| l.indent == ind && key_of(l.text) == Some(k))
                else {
                    break;
                };
                let l = region[pos];
                best = l.no;
                let value = strip_comment(after_key(l.text));
                if !value.is_empty() {
                    break; // inline scalar or flow collection: everything below is on this line
                }
                region = region[pos + 1..]
                    .iter()
                    .take_while(|c| c.indent > ind || (c.indent == ind && is_item(c.text)))
                    .copied()
                    .collect();
            }
            Seg::Index(i) => {
                let items: Vec<usize> = (0..region.len())
                    .filter(|&j| region[j].indent == ind && is_item(region[j].text))
                    .collect();
                let Some(&pos) = items.get(*i) else { break };
                let l = region[pos];
                best = l.no;
                let rest = l.text[1..].trim_start_matches(' ');
                let rest_indent = ind + (l.text.len() - rest.len());
                let mut next = Vec::new();
                if !rest.is_empty() {
                    if rest.starts_with('{') || rest.starts_with('[') || key_of(rest).is_none() {
                        break; // a flow item or a scalar: the item line is as deep as it gets
                    }
                    next.push(Line {
                        no: l.no,
                        indent: rest_indent,
                        text: rest,
                    });
                }
                next.extend(
                    region[pos + 1..]
                        .iter()
                        .take_while(|c| c.indent > ind)
                        .copied(),
                );
                region = next;
            }
        }
    }
    Some(best)
}

/// Where the policy sits in a bigger YAML file (a scenario's `policy:`); empty when the file
/// is itself a policy.
pub(crate) fn guess_base(src: &str) -> Vec<Seg> {
    let lines = content_lines(src);
    let Some(root) = lines.first().map(|l| l.indent) else {
        return Vec::new();
    };
    let root_keys: Vec<&str> = lines
        .iter()
        .filter(|l| l.indent == root)
        .filter_map(|l| key_of(l.text))
        .collect();
    if !root_keys
        .iter()
        .any(|k| *k == "version" || *k == "backends")
        && root_keys.contains(&"policy")
    {
        return vec![Seg::Key("policy".to_owned())];
    }
    Vec::new()
}

fn is_item(text: &str) -> bool {
    text == "-" || text.starts_with("- ")
}

/// The key of a `key: value` or `key:` line (quotes removed), if it is one.
fn key_of(text: &str) -> Option<&str> {
    if is_item(text) {
        return None;
    }
    if let Some(q) = text.chars().next().filter(|c| *c == '"' || *c == '\'') {
        let end = text[1..].find(q)? + 1;
        let after = &text[end + 1..];
        return (after.starts_with(':')).then(|| &text[1..end]);
    }
    let bytes = text.as_bytes();
    (0..bytes.len())
        .find(|&i| bytes[i] == b':' && (i + 1 == bytes.len() || bytes[i + 1] == b' '))
        .map(|i| text[..i].trim_end())
}

/// The value part of a `key: value` line.
fn after_key(text: &str) -> &str {
    let key_len = match text.chars().next() {
        Some(q @ ('"' | '\'')) => text[1..].find(q).map(|e| e + 2).unwrap_or(text.len()),
        _ => 0,
    };
    let bytes = text.as_bytes();
    (key_len..bytes.len())
        .find(|&i| bytes[i] == b':' && (i + 1 == bytes.len() || bytes[i + 1] == b' '))
        .map(|i| text[i + 1..].trim())
        .unwrap_or("")
}

fn strip_comment(value: &str) -> &str {
    if value.starts_with('#') {
        return "";
    }
    match value.find(" #") {
        Some(i) if !value.starts_with('"') && !value.starts_with('\'') => value[..i].trim_end(),
        _ => value,
    }
}
