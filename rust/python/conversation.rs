//! `specdraft.Conversation`: a multi-turn chat that carries the drafter's KV between turns.
//!
//! A text message is a user turn: the messages so far plus the new one are rendered with
//! the tokenizer's chat template (the assistant's turn opened), and only the text past what
//! the history already holds is tokenized and sent, so the history (and the drafter KV
//! carried with it) only ever grows. After the reply, the template's closing of the
//! assistant turn (`<|im_end|>\n` and the like) is appended to the history without
//! generating. If the template does not render the conversation as an extension of what
//! the history holds (a template that rewrites earlier turns, a reply that does not decode
//! back to itself), the next text turn starts the history afresh from the full rendering.
//!
//! A token-id message is appended to the history as it is, with no template.
//!
//! Invariant: the history is always a prefix of every later turn's prompt, so the carried
//! drafter KV describes the start of the next prompt.

use super::engine::PySpecEngine;
use super::errors::IntoPyResult;
use super::generation::{
    decode, encode, need_tokenizer, prompt_ids, render_chat, run_exclusive, text_tokens,
    to_py_result, GenerateOptions, PyGenerationResult,
};
use crate::engine::{Conversation, GenerateResult};
use crate::model::TargetModel;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use std::sync::{Mutex, MutexGuard, TryLockError};

/// The conversation and, for text turns, the messages and their rendering.
struct ChatSession {
    conv: Conversation<TargetModel>,
    /// `(role, content)` of every text turn so far.
    messages: Vec<(String, String)>,
    /// The template's rendering of `messages` that the history ends with; `None` when the
    /// history no longer extends it (the next text turn starts afresh).
    rendered: Option<String>,
}

/// A chat session that carries the drafter's KV from one turn to the next: each `send`
/// adds a turn to the history and generates the reply. Made by `SpecEngine.conversation()`.
#[pyclass(name = "Conversation", module = "specdraft", frozen)]
pub struct PyConversation {
    session: Mutex<ChatSession>,
    tokenizer: Option<Py<PyAny>>,
    eos: Vec<u32>,
}

fn messages_list<'py>(
    py: Python<'py>,
    messages: &[(String, String)],
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for (role, content) in messages {
        let d = PyDict::new(py);
        d.set_item("role", role)?;
        d.set_item("content", content)?;
        list.append(d)?;
    }
    Ok(list)
}

impl PyConversation {
    /// An empty conversation on `engine`.
    pub fn new(py: Python<'_>, engine: &PySpecEngine) -> Self {
        PyConversation {
            session: Mutex::new(ChatSession {
                conv: engine.engine.conversation(),
                messages: Vec::new(),
                rendered: Some(String::new()),
            }),
            tokenizer: engine.tokenizer.as_ref().map(|t| t.clone_ref(py)),
            eos: engine.eos().to_vec(),
        }
    }

    /// The session, or an error when another thread is using it (a conversation is one
    /// sequence of turns; waiting here while attached could deadlock).
    fn lock(&self) -> PyResult<MutexGuard<'_, ChatSession>> {
        match self.session.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(PyRuntimeError::new_err(
                "this conversation is in use by another thread; a conversation takes one turn at a time",
            )),
        }
    }

    fn send_ids(
        conv: &mut Conversation<TargetModel>,
        py: Python<'_>,
        ids: Vec<u32>,
        options: &GenerateOptions<'_, '_>,
    ) -> PyResult<GenerateResult> {
        let request = options
            .requests(vec![ids])?
            .pop()
            .ok_or_else(|| PyRuntimeError::new_err("no request was built"))?;
        py.detach(|| run_exclusive(|| conv.send(request))).py()
    }

    /// A user turn through the chat template; see the module documentation.
    fn send_text(
        &self,
        py: Python<'_>,
        s: &mut ChatSession,
        text: &str,
        options: &GenerateOptions<'_, '_>,
    ) -> PyResult<GenerateResult> {
        let tok = need_tokenizer(self.tokenizer.as_ref(), "a text message")?.bind(py);
        let mut messages = s.messages.clone();
        messages.push(("user".into(), text.into()));
        let prompt_text = render_chat(tok, messages_list(py, &messages)?.as_any(), true)?;
        let continues = s
            .rendered
            .as_deref()
            .filter(|before| prompt_text.starts_with(before))
            .map(str::len);
        let start = match continues {
            Some(len) => len,
            None => {
                // The history does not extend to this rendering: start afresh from all of it.
                let conv = &mut s.conv;
                py.detach(|| run_exclusive(|| conv.reset()));
                s.rendered = Some(String::new());
                0
            }
        };
        let delta = &prompt_text[start..];
        let result = Self::send_ids(&mut s.conv, py, encode(tok, delta)?, options)?;
        let content = decode(tok, text_tokens(&result, &self.eos))?;
        let so_far = prompt_text.clone() + &decode(tok, &result.tokens)?;
        messages.push(("assistant".into(), content));
        let full = render_chat(tok, messages_list(py, &messages)?.as_any(), false)?;
        s.rendered = match full.strip_prefix(&so_far) {
            Some(closing) => {
                s.conv.append(&encode(tok, closing)?);
                Some(full)
            }
            None => None,
        };
        s.messages = messages;
        Ok(result)
    }
}

#[pymethods]
impl PyConversation {
    /// Sends `message` and returns the reply. A string is a user turn, rendered with the
    /// tokenizer's chat template; the assistant's turn is closed after the reply. A list of
    /// token ids is appended to the history as it is. The options are `generate`'s. A bad
    /// request raises `RequestError` and changes nothing; a failure while running raises
    /// and leaves the history as it was.
    #[pyo3(signature = (message, max_tokens = 64, temperature = 0.0, top_p = 1.0, top_k = 0, seed = 0, grammar = None, ignore_eos = false))]
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        py: Python<'_>,
        message: &Bound<'_, PyAny>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: usize,
        seed: u64,
        grammar: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
    ) -> PyResult<PyGenerationResult> {
        let options = GenerateOptions::new(
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            grammar,
            ignore_eos,
        );
        let mut guard = self.lock()?;
        let result = match message.cast::<PyString>() {
            Ok(text) => self.send_text(py, &mut guard, &text.to_cow()?, &options)?,
            Err(_) => {
                let ids = prompt_ids(message, None)?;
                Self::send_ids(&mut guard.conv, py, ids, &options)?
            }
        };
        drop(guard);
        to_py_result(py, result, self.tokenizer.as_ref(), &self.eos)
    }

    /// Every token so far: prompts, replies and the template's turn closings.
    #[getter]
    fn history(&self) -> PyResult<Vec<u32>> {
        Ok(self.lock()?.conv.history().to_vec())
    }

    /// The text turns so far, as `{"role", "content"}` messages.
    #[getter]
    fn messages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let messages = self.lock()?.messages.clone();
        messages_list(py, &messages)
    }

    /// Drafter KV rows carried into the next turn (0 when none).
    #[getter]
    fn carried_rows(&self) -> PyResult<usize> {
        Ok(self.lock()?.conv.carried().map_or(0, |c| c.rows))
    }

    /// Forgets the history and the messages, and frees carried drafter KV.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        let mut guard = self.lock()?;
        let s = &mut *guard;
        let conv = &mut s.conv;
        py.detach(|| run_exclusive(|| conv.reset()));
        s.messages.clear();
        s.rendered = Some(String::new());
        Ok(())
    }
}
