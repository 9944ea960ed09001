"""The text the synthetic checkpoints' tokenizer is trained on: a few KB of English prose, code, JSON and
non-ASCII text (accented Latin, Greek, Cyrillic, CJK, Arabic, Devanagari, emoji), so that its merges cover
words, indentation and multi-byte characters alike. Changing it changes every synthetic tokenizer."""

CORPUS = r'''
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Inference engines turn trained weights into answers: they read a prompt, run the model one step at a time,
and stream the generated text back to whoever asked. Good engines are fast, but correct engines come first.
It's a truth universally acknowledged that a test which never fails isn't testing anything. We'll see.
Memory is the budget you can't renegotiate: the cache grows with every token, so pages are reused.
"Where are you going?" she asked. "Nowhere in particular," he replied, "but I'd like to get there soon."
In 1969, 600 million people watched the landing; 3.14159 is pi, 2.71828 is e, and 1,024 is 2**10.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday; January, February, March, April.
Questions? Answers! Lists: apples, oranges, pears; ranges 1-10 and 20--30; a path like /usr/local/bin.

def greedy_decode(model, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:
    """Append the most likely next token until the budget runs out or the model stops."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = model(ids)[-1]
        next_id = int(logits.argmax())
        if next_id == EOS_TOKEN_ID:
            break
        ids.append(next_id)
    return ids[len(prompt_ids):]


class PageTable:
    def __init__(self, num_pages: int, page_size: int = 128) -> None:
        self.free = list(range(num_pages))
        self.page_size = page_size

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"need {n} pages, {len(self.free)} free")
        pages, self.free = self.free[:n], self.free[n:]
        return pages

fn softmax(xs: &[f32]) -> Vec<f32> {
    let max = xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = xs.iter().map(|x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

const render = (messages) => messages.map(({ role, content }) => `${role}: ${content}`).join("\n");
for (let i = 0; i < 10; i++) { console.log(i * i); }

SELECT name, COUNT(*) AS n FROM requests WHERE status = 'done' GROUP BY name ORDER BY n DESC;

{"id": "req-1", "prompt": "Hello, world!", "max_tokens": 32, "temperature": 0.7, "stop": ["\n\n"]}
{"id": "req-2", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "tools": []}

# Heading
- item one
- item two with `inline code` and **bold** text
| column | value |
|--------|-------|
| alpha  | 0.5   |

Le café est très bon à Paris, où l'été est chaud. Ça va ? Élève, garçon, naïve, cœur, déjà vu.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Größe, Straße, Mädchen, schön, Fußgänger.
El niño comió una manzana en la mañana. ¿Dónde está la biblioteca? ¡Qué bueno! Señor, corazón.
A ação do coração não é fácil; São Paulo, João e Conceição estão lá. Tomé, avó, irmã.
Tiếng Việt có nhiều dấu: người, những, được, trường học, cảm ơn bạn rất nhiều.
Ελληνικά: Καλημέρα κόσμε, η γλώσσα είναι όμορφη. Φιλοσοφία, μαθηματικά, αλφάβητο.
Русский язык: Привет, мир! Как дела? Спасибо, хорошо. Москва, наука, программа, данные.
中文：你好，世界！我们今天学习语言模型。机器学习和人工智能正在改变世界。中文中文，模型模型。
日本語：こんにちは世界。今日はいい天気ですね。東京の桜はとても綺麗です。カタカナ、ひらがな、漢字。
한국어: 안녕하세요, 세계! 오늘 날씨가 좋네요. 감사합니다. 언어 모델은 재미있습니다.
العربية: مرحبا بالعالم، كيف حالك؟ شكرا جزيلا. اللغة العربية جميلة.
हिन्दी: नमस्ते दुनिया! आप कैसे हैं? धन्यवाद। भाषा मॉडल बहुत उपयोगी हैं।
Emoji: 😀😃😄 👍👍 🎉🎉 🚀 ❤️ 🇫🇷🇯🇵 👩‍💻 👨‍👩‍👧‍👦 🙂🙃 🌍🌏 ✅❌ ⭐️ 🤖
Math and symbols: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ ± × ÷ → ← ↔ ∀ ∃ ∈ ∉ λ μ π σ Ω € £ ¥ © ® ™ § ¶ … — – • °C
Whitespace runs:    four spaces,		two tabs,


and two blank lines above.
'''
